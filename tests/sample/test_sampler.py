"""Sampler: greedy, temperature, top-k, top-p, min-p and per-request seeds (no model)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.sampler import Sampler, SamplingMetadata

V = 50


def md(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None) -> SamplingMetadata:
    """Metadata as the ModelRunner builds it, for ``n`` rows (scalars broadcast)."""
    def col(x, dtype):
        return torch.tensor(x if isinstance(x, list) else [x] * n, dtype=dtype)

    temp, k, p, mp = col(temperature, torch.float32), col(top_k, torch.int64), \
        col(top_p, torch.float32), col(min_p, torch.float32)
    gens = []
    for i in range(n):
        s = seeds[i] if seeds is not None else None
        gens.append(None if s is None else torch.Generator().manual_seed(s))
    return SamplingMetadata(
        temperature=temp, top_k=k, top_p=p, min_p=mp, generators=gens,
        all_greedy=bool((temp == 0).all()),
        need_top_k=bool(((k > 0) & (temp > 0)).any()),
        need_top_p=bool(((p < 1) & (temp > 0)).any()),
        need_min_p=bool(((mp > 0) & (temp > 0)).any()))


def rand_logits(n, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * scale


def sample(logits, meta):
    return Sampler()(logits.clone(), meta)


def test_greedy_is_argmax():
    logits = rand_logits(16)
    out = sample(logits, md(16, temperature=0.0))
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch():
    logits = rand_logits(8)
    temps = [0.0, 1.0] * 4
    out = sample(logits, md(8, temperature=temps, seeds=list(range(8))))
    for i in range(0, 8, 2):
        assert out[i].item() == logits[i].argmax().item()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_1_equals_greedy(temperature):
    logits = rand_logits(32, seed=1)
    torch.manual_seed(0)
    out = sample(logits, md(32, temperature=temperature, top_k=1))
    assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-6, 0.01])
def test_tiny_top_p_equals_greedy(top_p):
    logits = rand_logits(32, seed=2, scale=0.5)      # flat: the top token has < 10% mass
    torch.manual_seed(0)
    out = sample(logits, md(32, temperature=1.0, top_p=top_p))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_min_p_one_equals_greedy():
    logits = rand_logits(32, seed=3)
    torch.manual_seed(0)
    out = sample(logits, md(32, temperature=1.0, min_p=1.0))
    assert out.tolist() == logits.argmax(-1).tolist()


def _empirical(logits_row, n, **kw):
    """Frequencies of ``n`` draws from one row (the row repeated n times, one seed)."""
    torch.manual_seed(1234)
    out = sample(logits_row.repeat(n, 1), md(n, **kw))
    return torch.bincount(out, minlength=logits_row.numel()).float() / n


PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = PROBS.log()
N = 40_000
TOL = 0.012                                   # > 4 standard errors at N = 40k


def test_temperature_1_matches_softmax():
    freq = _empirical(LOGITS, N, temperature=1.0)
    assert torch.allclose(freq, PROBS, atol=TOL), freq


def test_temperature_scales_logits():
    freq = _empirical(LOGITS, N, temperature=0.5)
    ref = (LOGITS / 0.5).softmax(-1)          # p^2 renormalised
    assert torch.allclose(freq, ref, atol=TOL), freq


def test_top_k_renormalises_over_the_k_best():
    freq = _empirical(LOGITS, N, temperature=1.0, top_k=3)
    ref = torch.zeros(6)
    ref[:3] = PROBS[:3] / PROBS[:3].sum()
    assert torch.allclose(freq, ref, atol=TOL), freq
    assert freq[3:].sum() == 0


def test_top_p_keeps_the_smallest_nucleus():
    # p = 0.7: 0.4 + 0.25 = 0.65 < 0.7, so the nucleus is the top three tokens (0.8).
    freq = _empirical(LOGITS, N, temperature=1.0, top_p=0.7)
    ref = torch.zeros(6)
    ref[:3] = PROBS[:3] / PROBS[:3].sum()
    assert torch.allclose(freq, ref, atol=TOL), freq
    assert freq[3:].sum() == 0


def test_min_p_drops_tokens_below_fraction_of_top():
    # min_p = 0.3: threshold 0.3 * 0.4 = 0.12 keeps 0.4, 0.25, 0.15.
    freq = _empirical(LOGITS, N, temperature=1.0, min_p=0.3)
    ref = torch.zeros(6)
    ref[:3] = PROBS[:3] / PROBS[:3].sum()
    assert torch.allclose(freq, ref, atol=TOL), freq
    # Without min_p the low tokens do appear.
    assert _empirical(LOGITS, N, temperature=1.0)[3:].sum() > 0.15


def test_top_k_and_top_p_combine():
    # top_k = 4 keeps 0.4, 0.25, 0.15, 0.1 (renormalised: 0.444, 0.278, 0.167, 0.111);
    # top_p = 0.6 then keeps 0.444 + 0.278 = 0.722 >= 0.6: the top two.
    freq = _empirical(LOGITS, N, temperature=1.0, top_k=4, top_p=0.6)
    ref = torch.zeros(6)
    ref[:2] = PROBS[:2] / PROBS[:2].sum()
    assert torch.allclose(freq, ref, atol=TOL), freq


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(99)
    target = rand_logits(1, seed=5, scale=1.0)[0]
    sampler = Sampler()

    def draws(batch_size, pos, steps=20, seed=42, **kw):
        """``steps`` draws of a seeded row placed at ``pos`` among unseeded/other rows."""
        gens = [None] * batch_size
        gens[pos] = torch.Generator().manual_seed(seed)
        toks = []
        for s in range(steps):
            logits = rand_logits(batch_size, seed=100 + s, scale=1.0)
            logits[pos] = target
            meta = md(batch_size, temperature=[0.0 if i % 3 == 2 else 1.0 for i in range(batch_size)],
                      **kw)
            meta.temperature[pos] = 1.0
            meta.all_greedy = False
            meta.generators = gens
            toks.append(sampler(logits, meta)[pos].item())
        return toks

    alone = draws(1, 0)
    assert len(set(alone)) > 3                 # it is really sampling
    assert draws(5, 0) == alone
    assert draws(7, 4) == alone
    assert draws(16, 15) == alone
    assert draws(4, 1, top_p=1.0) == alone
    # A different seed gives a different sequence.
    assert draws(1, 0, seed=43) != alone


def test_seeded_rows_do_not_advance_the_global_rng():
    logits = rand_logits(2, seed=6)
    torch.manual_seed(7)
    a = sample(logits, md(2, temperature=1.0, seeds=[1, None]))[1].item()
    torch.manual_seed(7)
    b = sample(logits[1:], md(1, temperature=1.0))[0].item()
    assert a == b


def test_top_k_1_is_greedy_even_with_ties():
    """Tied top logits (common when the LM head's output was rounded to bf16): top_k=1
    must pick what greedy picks, for every seed, not one of the tied tokens at random."""
    logits = rand_logits(4)
    logits[:, 7] = logits[:, 30] = logits.max() + 1.0       # a two-way tie at the top
    greedy_ids = sample(logits, md(4, temperature=0.0))
    assert greedy_ids.tolist() == [7] * 4
    for seed in range(6):
        got = sample(logits, md(4, temperature=1.0, top_k=1, seeds=[seed, seed + 1, None, seed]))
        assert got.tolist() == greedy_ids.tolist()
    mixed = sample(logits, md(4, temperature=[0.0, 1.0, 1.0, 1.0], top_k=[0, 1, 2, 1], seeds=[0, 1, 2, 3]))
    assert mixed[[0, 1, 3]].tolist() == [7, 7, 7] and mixed[2].item() in (7, 30)


def test_topk_path_keeps_what_the_sort_keeps():
    """Rows with top-k filter through topk over a power-of-two width; they keep exactly
    the tokens (and logits) a full sort keeps, with top-p on or off (p = 1 included)."""
    from pagedllm.sample.sampler import _apply_top_k_top_p, _sort_filter

    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 5000, generator=g) * 3
    k = torch.randint(1, 700, (48,), generator=g)
    k[:3] = torch.tensor([0, 1, 5000])            # off, greedy-like, the whole vocabulary
    p = torch.rand(48, generator=g) * 0.9 + 0.05
    p[::4] = 1.0
    for pp in (p, None):
        fast, ref = _apply_top_k_top_p(x, k, pp), _sort_filter(x, k, pp)
        keep = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(fast), keep)
        assert torch.equal(fast[keep], ref[keep])
        assert (keep.sum(dim=1) >= 1).all()


def test_topk_path_keeps_ties_at_the_kth_value_and_ignores_the_batch():
    """Ties at the k-th value survive together (as the sort keeps them), also when they
    reach past the topk width (the row then sorts); a row keeps the same set alone and
    in a batch of rows with other k."""
    from pagedllm.sample.sampler import _apply_top_k_top_p

    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2000, generator=g)
    x[0, :10] = 5.0                                # 10 tied at the top, k = 3
    x[1, :100] = 5.0                               # 100 tied, k = 3: past width 64
    k = torch.tensor([3, 3, 200])
    out = _apply_top_k_top_p(x, k, None)
    assert torch.isfinite(out[0]).sum() == 10 and torch.isfinite(out[1]).sum() == 100
    assert torch.isfinite(out[2]).sum() == 200
    p = torch.tensor([0.5, 0.9, 0.7])
    batched = _apply_top_k_top_p(x, k, p)
    for i in range(3):
        alone = _apply_top_k_top_p(x[i:i + 1], k[i:i + 1], p[i:i + 1])
        assert torch.equal(alone[0], batched[i])
