"""Engine-level invariance: a request's greedy output does not depend on what else runs
with it (batching, arrival times), on chunked prefill, on the prefix cache, on
preemption, or on the garbage in unused KV slots. References are the outputs of each
prompt run alone (``greedy_alone``), which test_correctness_hf ties to transformers.
"""
from __future__ import annotations

import math

import pytest

from engine_helpers import REF_TOKENS, engine_core, greedy, model_runner

pytestmark = pytest.mark.slow   # whole-engine invariance on the bundled model (32 prompts run alone first)


class StepRecorder:
    """A stat logger that records, per engine step, the batch the scheduler formed:
    (requests scheduled, tokens scheduled, requests running after the step)."""

    def __init__(self, llm):
        self.eng = llm.llm_engine
        self.steps: list[tuple[int, int, int]] = []

    def record(self, stats, it):
        if stats.step_num_reqs:
            self.steps.append((stats.step_num_reqs,
                               stats.step_num_prefill_tokens + stats.step_num_decode_tokens,
                               stats.num_running))

    def __enter__(self):
        self.eng.stat_loggers.append(self)
        return self

    def __exit__(self, *exc):
        self.eng.stat_loggers.remove(self)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got: list[list[int]], ref: list[list[int]]):
    assert len(got) == len(ref)
    bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
    assert not bad, (f"{len(bad)} of {len(ref)} outputs differ from the reference, first "
                     f"#{bad[0]}: {got[bad[0]]} != {ref[bad[0]]}")


def test_mixed_prompts_cover_the_intended_lengths(tokenizer, mixed_prompts):
    lens = sorted(len(tokenizer.encode(p)) for p in mixed_prompts)
    assert lens[0] <= 8 and lens[-1] >= 100 and len(set(lens)) >= 24


def test_batch_of_32_equals_alone(llm, mixed_prompts, greedy_alone):
    llm.reset_prefix_cache()
    before = llm.stats().num_preemptions_total
    with StepRecorder(llm) as rec:
        outs = llm.generate(mixed_prompts, greedy(REF_TOKENS), use_tqdm=False)
    assert [o.prompt for o in outs] == mixed_prompts
    assert_same(tokens(outs), greedy_alone)
    # It really ran as one batch: some steps computed all 32 requests together.
    assert max(s[0] for s in rec.steps) == 32
    assert llm.stats().num_preemptions_total == before
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_staggered_arrivals_equal_alone(llm, mixed_prompts, greedy_alone):
    """Requests join while others are mid-decode (and mid-way through their own
    prefill), through LLMEngine directly."""
    llm.reset_prefix_cache()
    eng = llm.llm_engine
    schedule = [(0, 5), (3, 6), (4, 1), (9, 10), (15, 3), (16, 2), (30, 5)]   # (step, how many)
    assert sum(n for _, n in schedule) == 32
    finished: dict[str, list[int]] = {}
    streamed: dict[str, list[int]] = {}
    nxt, step = 0, 0
    while nxt < 32 or eng.has_unfinished_requests():
        for at, n in schedule:
            if at == step:
                for _ in range(n):
                    eng.add_request(f"stag-{nxt}", mixed_prompts[nxt], greedy(REF_TOKENS))
                    nxt += 1
        for out in eng.step():
            streamed.setdefault(out.request_id, []).extend(out.delta_token_ids)
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 500
    got = [finished[f"stag-{i}"] for i in range(32)]
    assert_same(got, greedy_alone)
    # The streamed deltas add up to the final outputs.
    assert all(streamed[f"stag-{i}"] == got[i] for i in range(32))


def test_prefix_cached_batch_equals_alone(llm, mixed_prompts, greedy_alone):
    """Run the batch twice: the second time every prompt's full blocks come from the
    prefix cache (exactly floor((len - 1) / 16) blocks each)."""
    llm.reset_prefix_cache()
    llm.generate(mixed_prompts, greedy(1), use_tqdm=False)        # caches the prompts' blocks
    outs = llm.generate(mixed_prompts, greedy(REF_TOKENS), use_tqdm=False)
    assert_same(tokens(outs), greedy_alone)
    for o in outs:
        assert o.num_cached_tokens == (len(o.prompt_token_ids) - 1) // 16 * 16


def test_shared_prefix_in_one_batch(llm, greedy_alone, mixed_prompts):
    """Requests sharing a 64-token prefix submitted together: later ones hit blocks the
    first is writing in the very same step."""
    tok = llm.get_tokenizer()
    prefix = tok.encode(max(mixed_prompts, key=len))[:64]
    assert len(prefix) == 64
    prompts = [prefix + tok.encode(f" Question {i}: what is {i} times {i + 3}?") for i in range(4)]
    ref = []
    for p in prompts:
        llm.reset_prefix_cache()
        ref.append(llm.generate([{"prompt_token_ids": p}], greedy(8), use_tqdm=False)[0].outputs[0].token_ids)
    llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    assert_same(tokens(outs), ref)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_nan_in_unwritten_kv_slots_changes_nothing(backend, llm, make_llm, mixed_prompts, greedy_alone):
    """The KV cache is allocated uninitialised: fill it with NaN and check that no step
    reads a slot it has not written (a NaN would spread to the logits). Both the default
    attention path and the pure torch-ops one."""
    if backend != "auto":
        llm = make_llm(max_model_len=1024, kv_cache_memory="128MiB", attention_backend=backend)
    llm.reset_prefix_cache()                  # the old contents are about to be destroyed
    model_runner(llm.llm_engine).kv_cache.fill_(math.nan)
    idx = [0, 5, 9, 13, 18, 22, 27, 31]
    outs = llm.generate([mixed_prompts[i] for i in idx], greedy(REF_TOKENS), use_tqdm=False)
    assert_same(tokens(outs), [greedy_alone[i] for i in idx])


def test_chunked_prefill_equals_unchunked(make_llm, llm, long_prompts):
    chunked = make_llm(max_model_len=1024, max_num_batched_tokens=32, kv_cache_memory="128MiB")
    tok = llm.get_tokenizer()
    assert min(len(tok.encode(p)) for p in long_prompts) > 32
    llm.reset_prefix_cache()
    ref = tokens(llm.generate(long_prompts, greedy(REF_TOKENS), use_tqdm=False))
    chunked.reset_prefix_cache()
    with StepRecorder(chunked) as rec:
        got = tokens(chunked.generate(long_prompts, greedy(REF_TOKENS), use_tqdm=False))
    assert max(s[1] for s in rec.steps) <= 32
    # Prompts were split: the first steps ran only prefill chunks of the first request(s).
    total_prompt = sum(len(tok.encode(p)) for p in long_prompts)
    assert len(rec.steps) >= total_prompt // 32
    assert_same(got, ref)
    # Chunks on top of prefix-cache hits, too.
    assert_same(tokens(chunked.generate(long_prompts, greedy(REF_TOKENS), use_tqdm=False)), ref)


def test_preemption_under_a_tiny_kv_cache(make_llm, llm, mixed_prompts, greedy_alone):
    """12 blocks of 16 tokens (192 tokens) for 16 requests of up to ~120 tokens each: they
    can only finish by preempting and recomputing one another. The last four sample with
    seeds (admitted last, so the likeliest victims): recomputation must not disturb their
    random streams either."""
    from pagedllm import SamplingParams

    small = make_llm(num_gpu_blocks_override=12, block_size=16, max_model_len=192)
    assert engine_core(small.llm_engine).kv.num_blocks == 12
    tok = llm.get_tokenizer()
    idx = [i for i, p in enumerate(mixed_prompts) if len(tok.encode(p)) + REF_TOKENS <= 192][:16]
    assert len(idx) == 16
    prompts = [mixed_prompts[i] for i in idx]
    seeded = [SamplingParams(temperature=0.8, top_k=40, seed=100 + j, max_tokens=REF_TOKENS,
                             ignore_eos=True) for j in range(4)]
    params = [greedy(REF_TOKENS)] * 12 + seeded
    seeded_ref = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                  for p, sp in zip(prompts[12:], seeded)]
    before = small.stats().num_preemptions_total
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats().num_preemptions_total > before
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_same(tokens(outs), [greedy_alone[i] for i in idx[:12]] + seeded_ref)


def test_seeded_sampling_is_batch_invariant(llm, mixed_prompts):
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    target = mixed_prompts[7]
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True, seed=s)
              for t, n, s in [(0.0, 10, None), (1.0, 4, None), (0.7, 12, 9), (1.3, 10, None)]]
    batch = llm.generate(mixed_prompts[:4] + [target], others + [sp], use_tqdm=False)
    assert batch[4].outputs[0].token_ids == alone
    # Differently placed, with different neighbours, after other requests moved the
    # global RNG: still the same tokens.
    batch = llm.generate([target] + mixed_prompts[10:13], [sp] + others[1:], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321,
                                                       max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_string_ends_generation(llm, mixed_prompts, greedy_alone):
    """A stop string taken from the middle of a known greedy output (spanning token
    boundaries) truncates the text there; the tokens up to the stop are unchanged."""
    from pagedllm import SamplingParams

    tok = llm.get_tokenizer()
    i = next(i for i, ids in enumerate(greedy_alone)
             if len(tok.decode(ids[4:10]).strip()) >= 6)
    ids = greedy_alone[i]
    full = tok.decode(ids)
    piece = tok.decode(ids[4:10]).strip()[:6]
    cut = full.index(piece)
    sp = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True, stop=[piece])
    out = llm.generate([mixed_prompts[i]], sp, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", piece)
    assert out.text == full[:cut]
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < REF_TOKENS
    assert piece in tok.decode(out.token_ids)
    sp = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True, stop=[piece],
                        include_stop_str_in_output=True)
    assert llm.generate([mixed_prompts[i]], sp, use_tqdm=False)[0].outputs[0].text == full[:cut + len(piece)]


def test_stop_token_ids(llm, mixed_prompts, greedy_alone):
    from pagedllm import SamplingParams

    ids = greedy_alone[2]
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    sp = SamplingParams(temperature=0, max_tokens=REF_TOKENS, stop_token_ids=[stop_tok], ignore_eos=True)
    out = llm.generate([mixed_prompts[2]], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # As vLLM: the stop token stays in the token ids, its text only with include_stop_str_in_output
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(ids[:first])
    sp = SamplingParams(temperature=0, max_tokens=REF_TOKENS, stop_token_ids=[stop_tok], ignore_eos=True,
                        include_stop_str_in_output=True)
    out = llm.generate([mixed_prompts[2]], sp, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text) == (ids[: first + 1], tok.decode(ids[: first + 1]))


def test_eos_stops_unless_ignored(llm):
    from pagedllm import SamplingParams

    eos = llm.llm_engine.eos_token_ids
    prompt = "<|im_start|>user\nReply with one word: yes or no?<|im_end|>\n<|im_start|>assistant\n"
    full = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0]
    hits = [k for k, t in enumerate(full.token_ids) if t in eos]
    assert hits, f"the model was expected to end its short answer: {full.token_ids}"
    assert len(full.token_ids) == 16 and full.finish_reason == "length"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: hits[0] + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    # The EOS token is not part of the text, even with special tokens kept, unless
    # include_stop_str_in_output.
    assert out.text == llm.get_tokenizer().decode(full.token_ids[: hits[0]])
    tok = llm.get_tokenizer()
    for include in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=16, skip_special_tokens=False,
                            include_stop_str_in_output=include)
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full.token_ids[: hits[0] + 1]
        n = hits[0] + 1 if include else hits[0]
        assert out.text == tok.decode(full.token_ids[:n], skip_special_tokens=False)
    # min_tokens suppresses EOS until that many tokens exist.
    sp = SamplingParams(temperature=0, max_tokens=16, min_tokens=hits[0] + 2)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= hits[0] + 2
    assert not set(out.token_ids[: hits[0] + 2]) & eos


def test_runner_forgets_finished_requests(llm, mixed_prompts):
    """The persistent batch holds a row only while its request runs: the step after the
    last one (here an idle one) tells the runner what finished, and it frees the rows."""
    llm.generate(mixed_prompts[:3], greedy(4), use_tqdm=False)
    eng = llm.llm_engine
    runner = model_runner(eng)
    assert len(runner.requests) == 3
    eng.engine_core.get_output()
    assert not runner.requests and len(runner.input_batch) == 0
