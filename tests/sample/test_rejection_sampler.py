"""RejectionSampler: greedy verification, losslessness (chi-square), seeded batch
independence, shape errors; compute_probs (no model)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.sample.sampler import Sampler, SamplingMetadata, compute_probs

rs = RejectionSampler()


def meta(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None) -> SamplingMetadata:
    """Per-request metadata as the ModelRunner builds it (scalars broadcast; the filter
    flags count random rows only)."""
    def col(x, dtype):
        return torch.tensor(x if isinstance(x, list) else [x] * n, dtype=dtype)

    temp, k, p, mp = col(temperature, torch.float32), col(top_k, torch.int64), \
        col(top_p, torch.float32), col(min_p, torch.float32)
    random = (temp > 0) & (k != 1)
    gens = [None if seeds is None or seeds[i] is None else torch.Generator().manual_seed(seeds[i])
            for i in range(n)]
    return SamplingMetadata(
        temperature=temp, top_k=k, top_p=p, min_p=mp, generators=gens,
        all_greedy=not bool(random.any()),
        need_top_k=bool((random & (k > 0)).any()),
        need_top_p=bool((random & (p < 1)).any()),
        need_min_p=bool((random & (mp > 0)).any()))


def peaked(argmaxes, V=8):
    """Logits [len, V] whose row r has its maximum at ``argmaxes[r]``."""
    x = torch.zeros(len(argmaxes), V)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return x


# --------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------
def test_greedy_accepts_the_matching_prefix_then_the_argmax():
    drafts = [[3, 5, 1], [2, 4], [4], [], [6, 6]]
    argmax = [[3, 5, 1, 7],    # all accepted: bonus 7
              [2, 6, 0],       # second draft rejected: 6
              [1, 3],          # first draft rejected: 1
              [5],             # k = 0
              [0, 0, 0]]       # both rejected at the first: 0
    logits = peaked([t for row in argmax for t in row])
    out = rs(logits, drafts, meta(5, temperature=0.0))
    assert out == [[3, 5, 1, 7], [2, 6], [1], [5], [0]]


def test_greedy_ties_take_the_first_index():
    logits = torch.zeros(3, 8)
    logits[0, [2, 6]] = 4.0                   # tie: argmax is 2, so draft 6 is rejected
    logits[1, [1, 3]] = 4.0
    assert rs(logits[:2], [[6]], meta(1, temperature=0.0)) == [[2]]
    logits[0, [2, 6]] = 0.0
    logits[0, [6, 7]] = 4.0                   # tie: argmax is 6, draft 6 is accepted
    assert rs(logits[:2], [[6]], meta(1, temperature=0.0)) == [[6, 1]]


def test_top_k_1_is_greedy_in_a_random_batch():
    logits = torch.cat([peaked([3, 5, 2]), torch.randn(3, 8)])
    out = rs(logits, [[3, 4], [1, 2]], meta(2, temperature=[1.0, 1.0], top_k=[1, 0], seeds=[0, 1]))
    assert out[0] == [3, 5]


def test_k0_greedy_equals_sampler():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g)
    logits[3, [4, 9]] = logits[3].max() + 1.0          # a tie
    out = rs(logits, [[] for _ in range(16)], meta(16, temperature=0.0))
    assert [o[0] for o in out] == Sampler()(logits.clone(), meta(16, temperature=0.0)).tolist()


def test_k0_seeded_random_equals_sampler():
    """A k = 0 request draws V exponentials, as one Sampler step: the same tokens."""
    g = torch.Generator().manual_seed(1)
    kw = dict(temperature=[0.7, 1.0, 1.3], top_k=[0, 10, 0], top_p=[0.9, 1.0, 1.0],
              min_p=[0.0, 0.0, 0.05])
    m_rs, m_s = meta(3, seeds=[5, 6, 7], **kw), meta(3, seeds=[5, 6, 7], **kw)
    got, want = [], []
    for _ in range(20):
        logits = torch.randn(3, 50, generator=g)
        got.append([o[0] for o in rs(logits, [[], [], []], m_rs)])
        want.append(Sampler()(logits.clone(), m_s).tolist())
    assert got == want
    assert len({t for row in got for t in row}) > 10          # really sampling


def test_speculative_greedy_decoding_equals_plain_greedy_decoding():
    """A toy deterministic model (logits from a hash of the context) decoded greedily,
    one token at a time and with drafts from a noisy copy of the model: same tokens."""
    V = 16

    def model(ctx):
        return torch.randn(V, generator=torch.Generator().manual_seed(hash(tuple(ctx)) % 2**31))

    def drafter(ctx, k, g):
        out = []
        for _ in range(k):       # the right token 60% of the time, else a random one
            t = model(ctx + out).argmax().item() if torch.rand(1, generator=g) < 0.6 \
                else int(torch.randint(V, (1,), generator=g))
            out.append(t)
        return out

    prompt, n_new = [1, 2, 3], 40
    plain = list(prompt)
    while len(plain) < len(prompt) + n_new:
        plain.append(model(plain).argmax().item())

    g = torch.Generator().manual_seed(0)
    spec, accepted_some = list(prompt), False
    while len(spec) < len(prompt) + n_new:
        d = drafter(spec, 3, g)
        logits = torch.stack([model(spec + d[:j]) for j in range(len(d) + 1)])
        new = rs(logits, [d], meta(1, temperature=0.0))[0]
        accepted_some |= len(new) > 1
        spec += new
    assert accepted_some
    assert spec[:len(plain)] == plain


# --------------------------------------------------------------------------------------
# Losslessness (random rows)
# --------------------------------------------------------------------------------------
BASE = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
PERMS = [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 0, 4, 1, 5, 3]]   # per position
M = 20_000              # trials, one request each, all in one call
ALPHA = 1e-4            # false-failure rate of each chi-square test (for an unfixed seed)

# name -> (metadata settings, reference distribution from a position's base probs).
# The references are worked by hand from BASE: top_k=4 keeps .4 .25 .15 .1 (sum .9);
# top_p=0.8 of those keeps .444 .278 .167 (cumulative .889 >= .8); min_p=0.2 keeps
# tokens >= .08: .4 .25 .15 .1.
def _keep(b, n):
    w = torch.where(b >= b.sort(descending=True).values[n - 1], b, torch.zeros_like(b))
    return w / w.sum()


CASES = {
    "temperature": (dict(temperature=0.8), lambda b: b ** 1.25 / (b ** 1.25).sum()),
    "top_k_top_p": (dict(temperature=1.0, top_k=4, top_p=0.8), lambda b: _keep(b, 3)),
    "min_p": (dict(temperature=1.0, min_p=0.2), lambda b: _keep(b, 4)),
}


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of ``samples`` (token ids) to ``probs``;
    a token with probability 0 must never appear (asserted)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, counts
    expected = counts.sum() * probs.double()[support]
    assert expected.min() >= 5                      # the chi-square approximation holds
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def binomial_z(successes: int, n: int, p: float) -> float:
    return (successes - n * p) / (n * p * (1 - p)) ** 0.5


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("case", list(CASES))
def test_output_tokens_have_the_target_distribution(case, one_hot):
    """k = 2 drafts drawn from q != p: the first output token has distribution p0, the
    second (when the first draft was accepted) p1, the bonus (both accepted) p2, and the
    acceptance rate is what the algorithm promises (so "always reject" would fail)."""
    settings, ref = CASES[case]
    logits = torch.stack([BASE[perm].log() for perm in PERMS])                 # [3, V]
    p = [ref(BASE[perm]) for perm in PERMS]
    gq = torch.Generator().manual_seed(123)
    q = torch.randn(2, 6, generator=gq).softmax(-1)     # full support, incl. where p = 0
    drafts = torch.stack([torch.multinomial(q[j], M, replacement=True, generator=gq)
                          for j in range(2)], dim=1)                           # [M, 2]
    torch.manual_seed(7)
    out = rs(logits.repeat(M, 1), drafts.tolist(), meta(M, **settings),
             None if one_hot else q.repeat(M, 1))
    assert all(1 <= len(o) <= 3 for o in out)
    assert all(o[:len(o) - 1] == d[:len(o) - 1] for o, d in zip(out, drafts.tolist()))

    first = torch.tensor([o[0] for o in out])
    second = torch.tensor([o[1] for o in out if len(o) >= 2])
    bonus = torch.tensor([o[2] for o in out if len(o) == 3])
    for samples, dist in ((first, p[0]), (second, p[1]), (bonus, p[2])):
        assert chi2_pvalue(samples, dist) > ALPHA

    # P(accept draft j) = sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p, q) (one-hot:
    # sum_x q(x) p(x)); the two acceptances are independent here. |z| > 4.5: ~7e-6.
    rate = [(torch.minimum(p[j], q[j]) if not one_hot else p[j] * q[j]).sum().item()
            for j in range(2)]
    assert abs(binomial_z(len(second), M, rate[0])) < 4.5
    assert abs(binomial_z(len(bonus), len(second), rate[1])) < 4.5


def test_one_hot_fixed_draft_keeps_p():
    """A fixed one-hot proposal (as from an n-gram proposer): accepted with probability
    p(d), else the residual p without d; overall still p."""
    settings, ref = CASES["temperature"]
    logits = BASE.log().unsqueeze(0)
    p = ref(BASE)
    torch.manual_seed(8)
    out = rs(logits.repeat(2, 1).repeat(M, 1), [[1]] * M, meta(M, **settings))
    first = torch.tensor([o[0] for o in out])
    assert chi2_pvalue(first, p) > ALPHA
    assert abs(binomial_z(sum(len(o) == 2 for o in out), M, p[1].item())) < 4.5


def test_residual_all_zero_falls_back_to_p():
    """q = p, and a draft token both exclude (q(d) = p(d) = 0, possible with one-hot
    proposals or rounding): always rejected, and max(0, p - q) is zero everywhere, so the
    token comes from p."""
    logits = torch.tensor([[0.0, 0.0, -float("inf"), 0.0]])
    q = torch.tensor([[1 / 3, 1 / 3, 0.0, 1 / 3]])
    torch.manual_seed(0)
    n = 3000
    out = rs(logits.repeat(2 * n, 1), [[2]] * n, meta(n), q.repeat(n, 1))
    assert all(len(o) == 1 for o in out)
    first = torch.tensor([o[0] for o in out])
    assert chi2_pvalue(first, torch.tensor([1 / 3, 1 / 3, 0, 1 / 3])) > ALPHA


# --------------------------------------------------------------------------------------
# Seeds, mixed batches
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_seeded_request_is_independent_of_the_batch(one_hot):
    V, k = 40, 3

    def run(n, pos, steps=12, seed=42):
        """``steps`` verifications of a seeded request at ``pos`` among ``n`` requests
        (greedy, unseeded and other seeded ones, with different k)."""
        gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
        gens[pos] = torch.Generator().manual_seed(seed)
        outs = []
        for s in range(steps):
            g = torch.Generator().manual_seed(s)
            ks = [k if i == pos else (i * 2 + s) % 4 for i in range(n)]
            logits = torch.randn(sum(ks) + n, V, generator=g)
            drafts = [torch.randint(V, (ki,), generator=g).tolist() for ki in ks]
            q = torch.randn(sum(ks), V, generator=g).softmax(-1)
            # The seeded request's own inputs are the same in every batch.
            gmine = torch.Generator().manual_seed(10_000 + s)
            mine_logits = torch.randn(k + 1, V, generator=gmine) * 0.5
            mine_logits[:k, torch.randint(V, (k,), generator=gmine)] += 3.0
            mine_drafts = mine_logits[:k].argmax(-1).tolist()
            mine_q = (mine_logits[:k] * 1.3).softmax(-1)
            start, dstart = sum(ks[:pos]) + pos, sum(ks[:pos])
            logits[start:start + k + 1] = mine_logits
            q[dstart:dstart + k] = mine_q
            drafts[pos] = mine_drafts
            m = meta(n, temperature=[0.0 if i % 3 == 2 else 0.9 for i in range(n)], top_p=0.95)
            m.temperature[pos] = 0.9
            m.all_greedy = False
            m.generators = [None if i % 4 == 1 and i != pos else gens[i] for i in range(n)]
            outs.append(rs(logits, drafts, m, None if one_hot else q)[pos])
        return outs

    alone = run(1, 0)
    assert len({len(o) for o in alone}) > 1 and len({tuple(o) for o in alone}) > 6
    assert run(5, 0) == alone
    assert run(7, 4) == alone
    assert run(9, 8) == alone
    assert run(4, 1, seed=43) != alone


def test_mixed_batch_greedy_rows_match_an_all_greedy_batch():
    g = torch.Generator().manual_seed(3)
    ks = [2, 3, 0, 1, 2]
    logits = torch.randn(sum(ks) + 5, 30, generator=g)
    drafts = [logits[sum(ks[:i]) + i: sum(ks[:i]) + i + ki].argmax(-1).tolist()
              for i, ki in enumerate(ks)]
    drafts[1][1] = (drafts[1][1] + 1) % 30                    # a mismatch in request 1
    temps = [0.0, 0.0, 1.0, 0.0, 1.0]
    mixed = rs(logits, drafts, meta(5, temperature=temps, seeds=[0, 1, 2, 3, 4]))
    greedy = rs(logits, drafts, meta(5, temperature=0.0))
    for i in (0, 1, 3):
        assert mixed[i] == greedy[i]
    assert greedy[1] == drafts[1][:1] + [logits[sum(ks[:1]) + 1 + 1].argmax().item()]
    for i in (2, 4):
        assert 1 <= len(mixed[i]) <= ks[i] + 1 and mixed[i][:-1] == drafts[i][:len(mixed[i]) - 1]


def test_empty_batch():
    assert rs(torch.zeros(0, 8), [], meta(0)) == []


# --------------------------------------------------------------------------------------
# Errors, compute_probs
# --------------------------------------------------------------------------------------
def test_bad_shapes_raise():
    assert len(rs(torch.zeros(4, 8), [[1, 2], []], meta(2), torch.full((2, 8), 1 / 8))) == 2
    with pytest.raises(ValueError, match=r"sum\(k_i \+ 1\) = 4"):
        rs(torch.zeros(5, 8), [[1, 2], []], meta(2))
    with pytest.raises(ValueError, match="draft_probs"):
        rs(torch.zeros(4, 8), [[1, 2], []], meta(2), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="draft_probs"):
        rs(torch.zeros(4, 8), [[1, 2], []], meta(2), torch.zeros(2, 7))
    with pytest.raises(ValueError, match="3 rows for 2 requests"):
        rs(torch.zeros(4, 8), [[1, 2], []], meta(3))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        rs(torch.zeros(4, 8), [[1, 8], []], meta(2))
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        rs(torch.zeros(4), [[1, 2], []], meta(2))


def test_compute_probs_is_the_filtered_renormalised_distribution():
    logits = torch.stack([BASE[perm].log() for perm in PERMS])
    for settings, ref in CASES.values():
        got = compute_probs(logits, meta(3, **settings))
        assert got.dtype == torch.float32 and got.shape == (3, 6)
        for r, perm in enumerate(PERMS):
            assert torch.allclose(got[r], ref(BASE[perm]), atol=1e-6)
    # Greedy rows: finite.
    m = meta(3, temperature=[0.0, 1.0, 1.0], top_k=[0, 1, 2], min_p=[0.5, 0.0, 0.0])
    m.need_top_k = m.need_min_p = True
    assert torch.isfinite(compute_probs(logits * 100, m)).all()
