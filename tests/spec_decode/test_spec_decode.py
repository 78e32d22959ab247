"""Speculative decoding end to end: greedy output is exactly the non-speculative output for
every method and draft length, in batches that mix copy-heavy and non-repetitive prompts
with sampled requests, with chunked prefill, prefix caching and preemption; finish
conditions that land inside an accepted chunk cut it where plain decoding stops; the
counters show drafts accepted on copy-heavy prompts. (The rejection sampler's
distribution is tested in test_rejection_sampler.py, the proposers in
test_ngram_proposer.py / test_suffix_proposer.py.)

Every engine here shares the bundled model's weights (conftest ``make_llm``); the
bundled model as its own draft accepts every greedy draft, a random-weight draft almost
none, so both ends of the acceptance range run.
"""
from __future__ import annotations

import json

import pytest
from engine_helpers import engine_core

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.errors import InvalidParameterError
from pagedllm.platform import has_native_bf16

MAX_TOKENS = 20
PLAIN_KW = dict(max_model_len=1024, kv_cache_memory="512MiB")

_PASSAGE = ("The river crosses the old town under seven stone bridges, and every spring the "
            "water rises high enough to cover the lower steps of the market square.")
_CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


def _copy_prompts() -> list[str]:
    """Prompts whose continuation repeats text of the prompt."""
    return [
        f"Repeat the text exactly.\nText: {_PASSAGE}\nRepeated: {_PASSAGE}\nRepeated again:",
        f"{_CODE}\n# the same code again\n{_CODE}\n# once more\n",
        "one two three four five six seven eight nine ten\n" * 3 + "one two",
        f"Quote: \"{_PASSAGE}\"\nThe quote again: \"",
    ]


@pytest.fixture(scope="module")
def prompts(mixed_prompts) -> list[str]:
    return _copy_prompts() + mixed_prompts[:3]


def _greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def reference(make_llm, prompts):
    llm = make_llm(**PLAIN_KW)
    return [c.token_ids for c in _run(llm, prompts, _greedy())]


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_dir) -> str:
    """A random-weight 2-layer Llama (transformers' default init) with the bundled model's
    tokenizer (its drafts are almost always rejected)."""
    return tiny_model_dir("llama", std=None, vocab_size=49152, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=2048, tie_word_embeddings=True)


def _spec(method: str, k: int, model_path: str, tiny_draft: str) -> str:
    if method == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                           "prompt_lookup_max": 4})
    if method == "suffix":
        return json.dumps({"method": "suffix", "num_speculative_tokens": k})
    draft = model_path if method == "draft_self" else tiny_draft
    return json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": k})


def _counters(llm):
    s = engine_core(llm.llm_engine).scheduler
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


@pytest.mark.slow
@pytest.mark.parametrize("method,k", [
    ("ngram", 1), ("ngram", 3), ("ngram", 8), ("suffix", 3), ("suffix", 8),
    ("draft_self", 1), ("draft_self", 3), ("draft_self", 8), ("draft_tiny", 3)])
def test_greedy_output_unchanged(make_llm, prompts, reference, model_path, tiny_draft, method, k):
    llm = make_llm(**PLAIN_KW, speculative_config=_spec(method, k, model_path, tiny_draft))
    before = _counters(llm)
    got = [c.token_ids for c in _run(llm, prompts, _greedy())]
    assert got == reference
    drafts, draft_tokens, accepted = (a - b for a, b in zip(_counters(llm), before))
    assert drafts > 0 and draft_tokens >= drafts
    if method != "draft_tiny":
        assert accepted > 0, "copy-heavy prompts must accept drafts"
    if method == "draft_self":   # the target drafting for itself: every greedy draft is right
        assert accepted == draft_tokens


@pytest.mark.slow
def test_batch_mixed_with_sampled_requests_and_staggered_arrivals(make_llm, prompts, reference, model_path,
                                                                   tiny_draft):
    """Greedy requests keep their output when sampled requests (with and without seeds)
    share their steps, and when they arrive while others are mid-speculation."""
    llm = make_llm(**PLAIN_KW, speculative_config=_spec("ngram", 4, model_path, tiny_draft))
    eng = llm.llm_engine
    sampled = [SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, seed=7, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True)]
    pending = list(range(len(prompts)))
    got: dict[str, list[int]] = {}
    ids = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 3 == 0:   # one new greedy request every third step
            i = pending.pop(0)
            ids[f"g{i}"] = i
            eng.add_request(f"g{i}", prompts[i], _greedy())
            eng.add_request(f"s{i}", prompts[i], sampled[i % 2])
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [got[f"g{i}"] for i in range(len(prompts))] == reference
    for i in range(len(prompts)):
        assert len(got[f"s{i}"]) == MAX_TOKENS


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(make_llm, prompts, model_path, tiny_draft):
    """A seeded request's tokens do not depend on the batch, though the step-level draft
    choice does: its draft count follows its own history only."""
    llm = make_llm(**PLAIN_KW, speculative_config=_spec("ngram", 3, model_path, tiny_draft))
    sp = SamplingParams(temperature=0.9, top_k=50, max_tokens=2 * MAX_TOKENS, seed=123, ignore_eos=True)
    alone = _run(llm, prompts[:1], sp)[0].token_ids
    batched = _run(llm, prompts[:5], [sp] + [_greedy(2 * MAX_TOKENS)] * 4)[0].token_ids
    assert alone == batched and len(alone) == 2 * MAX_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_preemption_and_chunked_prefill(make_llm, prompts, reference, model_path, tiny_draft, method):
    """A KV cache too small for the batch (preemptions) and a 32-token budget (chunked
    prompts, drafts cut by the budget) leave greedy output unchanged; the draft model's
    state is rebuilt when its request resumes."""
    llm = make_llm(max_model_len=224, num_gpu_blocks_override=14, block_size=16,
                   max_num_batched_tokens=32, speculative_config=_spec(method, 4, model_path, tiny_draft))
    core = engine_core(llm.llm_engine)
    p0 = core.scheduler.num_preemptions_total
    got = [c.token_ids for c in _run(llm, prompts, _greedy())]
    assert got == reference
    assert core.scheduler.num_preemptions_total > p0
    assert _counters(llm)[2] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_prefix_caching(make_llm, prompts, reference, model_path, tiny_draft, method):
    llm = make_llm(**PLAIN_KW, speculative_config=_spec(method, 3, model_path, tiny_draft))
    llm.generate(prompts[:4], _greedy(4), use_tqdm=False)   # warm the cache with the copy prompts
    got = [c.token_ids for c in _run(llm, prompts, _greedy())]
    assert got == reference


@pytest.mark.slow
def test_finish_conditions_inside_an_accepted_chunk(make_llm, prompts, model_path, tiny_draft):
    """The bundled model drafting for itself accepts all 4 drafts per step, so each stop
    below lands inside a chunk of 5 tokens: output must be cut exactly as without
    speculation, and nothing after the stop returned."""
    plain = make_llm(**PLAIN_KW)
    spec = make_llm(**PLAIN_KW, speculative_config=_spec("draft_self", 4, model_path, tiny_draft))
    ref = _run(plain, prompts[:1], _greedy())[0]
    toks = ref.token_ids
    j = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i])   # first occurrence
    text_stop = plain.get_tokenizer().decode(toks[j - 2: j])
    cases = [
        _greedy(max_tokens=5),
        _greedy(stop_token_ids=[toks[j]]),
        _greedy(stop_token_ids=[toks[j]], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[text_stop]),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[text_stop], include_stop_str_in_output=True),
        _greedy(min_tokens=12, stop_token_ids=[toks[2]]),
    ]
    for sp in cases:
        want = _run(plain, prompts[:1], sp)[0]
        got = _run(spec, prompts[:1], sp)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), sp
    assert _run(spec, prompts[:1], cases[0])[0].token_ids == toks[:5]
    assert _run(spec, prompts[:1], cases[1])[0].token_ids == toks[: j + 1]
    # the stop token, last of its chunk, is in the text only with include_stop_str_in_output
    tok = plain.get_tokenizer()
    assert _run(spec, prompts[:1], cases[1])[0].text == tok.decode(toks[:j])
    assert _run(spec, prompts[:1], cases[2])[0].text == tok.decode(toks[: j + 1])


@pytest.mark.slow   # ~11 s: three engines (the fast tier keeps the speculation smoke tests)
def test_streaming_deltas_concatenate(make_llm, prompts, model_path, tiny_draft):
    """Several tokens arrive per step; the streamed deltas still add up to the text."""
    llm = make_llm(**PLAIN_KW, speculative_config=_spec("draft_self", 4, model_path, tiny_draft))
    eng = llm.llm_engine
    eng.add_request("stream", prompts[0], _greedy())
    deltas, sizes, final = [], [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.delta_text if hasattr(out, "delta_text") else "")
            sizes.append(len(out.delta_token_ids) if hasattr(out, "delta_token_ids") else 0)
            if out.finished:
                final = out
    assert max(sizes) > 1
    assert "".join(deltas) == final.outputs[0].text


@pytest.mark.slow
@pytest.mark.skipif(not has_native_bf16(), reason="no bf16 arithmetic on this CPU (float32 is its default)")
def test_greedy_output_unchanged_in_bfloat16(make_llm, prompts, model_path, tiny_draft):
    plain = make_llm(**PLAIN_KW, dtype="bfloat16")
    ref = [c.token_ids for c in _run(plain, prompts, _greedy())]
    for method in ("ngram", "draft_self"):
        llm = make_llm(**PLAIN_KW, dtype="bfloat16", speculative_config=_spec(method, 3, model_path, tiny_draft))
        assert [c.token_ids for c in _run(llm, prompts, _greedy())] == ref


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize("value,match", [
    ("{not json", "not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method must be one of"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "typo": 1}', "unknown field `typo`; known keys: method, "),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_arch": {}}', "unknown key 'draft_arch'"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', r"Expected `int`, got `str` - at `\$.num_speculative_tokens`"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs 'model'"),
    ('{"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 3}', "does not exist"),
    ('{"method": "draft_model", "model": ["/tmp"], "num_speculative_tokens": 3}', r"got `array` - at `\$.model`"),
    ("[1, 2]", "JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "/x"}', "only apply to method 'draft_model'"),
    ('{"method": "suffix", "prompt_lookup_min": 2}', "only apply to method 'ngram'"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "adaptive": "no"}', r"Expected `bool`, got `str` - at `\$.adaptive`"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2.0}', "min_token_prob must be a number in"),
])
def test_bad_speculative_config_names_the_flag(value, match):
    with pytest.raises(InvalidParameterError, match=match) as e:
        EngineArgs(speculative_config=value).validate()
    assert e.value.param == "speculative_config"


def test_bad_speculative_config_names_the_cli_flag():
    with pytest.raises(InvalidParameterError) as e:
        EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "typo": 1}').validate()
    assert EngineArgs.cli_message(e.value).startswith("--speculative-config: Object contains unknown field `typo`")


def test_speculative_config_struct_rejects_unknown_keys():
    import msgspec

    with pytest.raises(msgspec.ValidationError, match="unknown field `typo`"):
        msgspec.convert({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, SpeculativeConfig)


def test_speculative_config_defaults_follow_vllm():
    s = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (s.prompt_lookup_min, s.prompt_lookup_max, s.num_lookahead_slots) == (3, 3, 0)
    s = SpeculativeConfig.parse('{"method": "suffix"}')
    assert s.num_speculative_tokens == s.suffix_decoding_max_tree_depth == 24


@pytest.mark.parametrize("path", ["/tmp", "/etc/passwd"])
def test_unloadable_draft_model_names_speculative_config(path):
    from pagedllm.config import EngineConfig

    spec = json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    with pytest.raises(InvalidParameterError, match="speculative_config: draft model") as e:
        EngineConfig.from_args(EngineArgs(dtype="float32", device="cpu", speculative_config=spec))
    assert e.value.param == "speculative_config"
    assert "--model" not in str(e.value)     # the draft's path is not the --model flag's


def test_the_draft_architecture_is_read_once(tiny_draft, monkeypatch):
    from pagedllm.config import EngineConfig
    from pagedllm.models import loader
    from pagedllm.spec_decode.proposer import DraftModelProposer

    real, reads = loader.load_arch_config, []
    monkeypatch.setattr(loader, "load_arch_config", lambda path: reads.append(path) or real(path))
    spec = json.dumps({"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2})
    cfg = EngineConfig.from_args(EngineArgs(dtype="float32", device="cpu", speculative_config=spec))
    draft_arch = cfg.speculative_config.draft_arch
    assert (draft_arch.num_hidden_layers, draft_arch.hidden_size, draft_arch.vocab_size) == (2, 64, 49152)
    assert SpeculativeConfig.parse(spec).draft_arch is None      # the JSON alone reads nothing
    proposer = DraftModelProposer(cfg)
    assert proposer.arch is draft_arch
    assert reads.count(tiny_draft) == 1


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, safe_serialization=True)
    from pagedllm.config import EngineConfig

    spec = json.dumps({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(InvalidParameterError, match="vocabulary") as e:
        EngineConfig.from_args(EngineArgs(dtype="float32", device="cpu", speculative_config=spec))
    assert e.value.param == "speculative_config"


def test_adaptive_draft_length_fallback_rule_and_probes():
    from pagedllm.spec_decode.adaptive import AdaptiveDraftLength

    a = AdaptiveDraftLength(8, min_gain=0.25, probe_interval=4)
    assert a.choose(["r"], [8], 1) == [4]          # prior acceptance 0.75, no cost data yet
    assert a.choose(["r"], [2], 1) == [2]          # never more than proposed
    for _ in range(10):
        a.record("r", 8, 8)
    assert a.choose(["r"], [8], 1) == [8]
    for _ in range(30):      # each all-rejected step is one failed position
        a.record("r", 4, 0)
    for _ in range(30):
        a.record("s", 4, 0)
    ks = [a.choose(["r", "s"], [4, 4], 2) for _ in range(12)]
    # off, with one one-draft probe every 4th step for the whole batch, taking turns
    assert [k[0] for k in ks] == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert [k[1] for k in ks] == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert AdaptiveDraftLength(5, enabled=False).choose(["x"], [5], 1) == [5]
    a.remove("r")
    assert a.choose(["r"], [8], 1) == [4]


def test_adaptive_draft_length_maximises_step_throughput():
    """With a measured cost per scored-token count, the drafts kept are those that
    maximise expected tokens per second, across requests."""
    from pagedllm.spec_decode.adaptive import AdaptiveDraftLength

    a = AdaptiveDraftLength(4, probe_interval=100)
    for t, ms in ((1, 80), (2, 82), (3, 84), (4, 86), (5, 88)):   # batch 1: drafts cheap
        for _ in range(4):
            a.cost_model.record(t, ms / 1e3)
    for _ in range(20):
        a.record("good", 4, 4)
    assert a.choose(["good"], [4], 1) == [4]
    for _ in range(40):
        a.record("bad", 4, 0)      # acceptance ~0: its drafts add nothing
    assert a.choose(["bad"], [4], 1) == [0]
    b = AdaptiveDraftLength(4, probe_interval=100)
    for t in range(8, 17):        # batch 8: a step function, 8 -> 9 rows +20 ms
        for _ in range(4):
            b.cost_model.record(t, (0.112 if t == 8 else 0.132 + 0.003 * (t - 9)))
    for _ in range(6):
        b.record("half", 4, 1)     # a ~ 0.5
    # 8 decoding, one request with a ~ 0.5: 4 drafts add ~0.94 tokens for +29 ms: not worth it
    assert b.choose(["half"], [4], 8) == [0]
    for _ in range(20):
        b.record("sure", 4, 4)
    assert b.choose(["sure", "half"], [4, 4], 8)[0] == 4
    # a seeded request's count is its own rule's (a ~ 0.5: k = 2 at min_gain 0.25), whatever the batch
    assert b.choose(["half"], [4], 8, independent=[True]) == [2]
    assert b.choose(["sure", "half"], [4, 4], 8, independent=[False, True]) == [4, 2]


def test_scheduler_caps_drafts_and_frees_rejected_blocks():
    """Drafts are cut to what max_tokens, max_model_len and the budget allow; blocks
    that held only rejected slots are freed and reported to the runner."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.messages import ModelRunnerOutput

    kv = KVCacheManager(64, 4, enable_caching=True)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    req = Request("a", list(range(10, 15)), SamplingParams(max_tokens=6, ignore_eos=True), set())
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["a"], [[100]], [[1, 2, 3, 4, 5, 6, 7, 8]]))
    assert req.spec_token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    so = s.schedule()
    # 1 output so far, max_tokens 6: at most 4 drafts (+ the target's own token = 5 more)
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 4]}
    assert so.num_scheduled_tokens == {"a": 5}
    assert len(kv.get_block_ids("a")) == 3          # 6 known tokens + 4 drafts = 10 slots
    # every draft rejected: 7 known tokens, the third block held only rejected slots
    s.update_from_output(so, ModelRunnerOutput(["a"], [[200]], [[7, 8]]))
    assert (req.num_computed_tokens, req.num_tokens) == (6, 7)
    assert len(kv.get_block_ids("a")) == 2 and s.num_freed_blocks == {"a": 1}
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 4, 0)
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [7, 8]}
    assert so.scheduled_cached_reqs.num_freed_blocks == [1]       # the runner drops it first
    assert len(so.scheduled_cached_reqs.new_block_ids[0][0]) == 1     # 6 + 3 slots: a third block again
    s.update_from_output(so, ModelRunnerOutput(["a"], [[7, 8, 300]], [[]]))
    assert (req.num_computed_tokens, req.num_tokens) == (9, 10)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 2)
    assert s.num_accepted_tokens_per_pos == [1, 1, 0, 0]
    assert req.output_token_ids == [100, 200, 7, 8, 300]
    s.finish_requests(["a"])
    assert kv.num_free_blocks == kv.num_blocks and s.num_freed_blocks == {}


def test_spec_metrics_exported():
    from pagedllm.engine.metrics import IterationStats, PrometheusStatLogger
    from pagedllm.messages import SchedulerStats

    p = PrometheusStatLogger("m")
    p.record(SchedulerStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9,
                            spec_decode_num_accepted_tokens=5,
                            spec_decode_num_accepted_tokens_per_pos=[3, 2, 0]), IterationStats())
    p.record(SchedulerStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                            spec_decode_num_accepted_tokens=8,
                            spec_decode_num_accepted_tokens_per_pos=[4, 3, 1]), IterationStats())
    from prometheus_client import generate_latest

    text = generate_latest(p.registry).decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 4.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 8.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0'):
            assert line in text, line


def test_step_cost_model():
    from pagedllm.spec_decode.adaptive import StepCostModel

    m = StepCostModel(min_steps=4, min_count=3)
    assert m.cost(4) is None                          # no data yet
    for t in (1, 3, 6, 2, 5, 4):
        m.record(t, 0.040 + 0.002 * t)                # 40 ms + 2 ms per scored token
    assert abs(m.per_token_seconds() - 0.002) < 1e-9
    assert abs(m.cost(10) - 0.060) < 1e-9             # unseen T: the line
    for _ in range(3):
        m.record(8, 0.100)                            # a T seen often enough: its own average
    assert abs(m.cost(8) - 0.100) < 1e-3
    flat = StepCostModel(min_steps=2)
    for _ in range(5):
        flat.record(8, 0.1)
    assert flat.per_token_seconds() is None and flat.cost(9) is None   # no slope, T unseen


@pytest.mark.slow   # ~4 s (fast-tier budget)
def test_bench_spec_workload_runner(make_llm, model_path, tiny_draft):
    """``bench spec``'s runner on an engine of this module: counters and figures come from
    the run, outputs are the greedy ones, bad method flags fail before any model loads."""
    from pagedllm.benchmarks.spec import copy_conversations, random_conversations, run_workload, spec_config

    llm = make_llm(**PLAIN_KW, speculative_config=_spec("ngram", 3, model_path, tiny_draft))
    plain = make_llm(**PLAIN_KW)
    eng = llm.llm_engine
    prompts = [eng.apply_chat_template(c) for c in copy_conversations()[:2] + random_conversations()[:1]]
    r = run_workload(llm, prompts, 12, 2)
    ref = run_workload(plain, prompts, 12, 2)
    assert r["_outputs"] == ref["_outputs"] and r["output_tokens"] == 36
    assert r["num_drafts"] > 0 and 0 <= r["num_accepted_tokens"] <= r["num_draft_tokens"]
    assert ref["num_drafts"] == 0 and ref["acceptance_rate"] is None
    assert json.loads(spec_config("ngram", 7, None))["num_speculative_tokens"] == 7
    with pytest.raises(ValueError, match="--draft-model"):
        spec_config("draft_model", 3, None)
    with pytest.raises(ValueError, match="does not exist"):
        spec_config("draft_model", 3, "/nonexistent.gguf")


def test_adaptive_draft_length_pays_for_a_draft_model():
    """A draft model's forwards count: drafts that would pay for the target's extra
    positions alone are dropped when proposing them costs more than they return."""
    from pagedllm.spec_decode.adaptive import AdaptiveDraftLength

    a = AdaptiveDraftLength(4, probe_interval=100)
    for t in range(1, 6):
        for _ in range(4):
            a.cost_model.record(t, 0.080 + 0.002 * t)
    for _ in range(6):
        a.record("r", 4, 1)                 # a ~ 0.5: 4 drafts add ~0.94 tokens
    assert a.choose(["r"], [4], 1) == [4]   # free proposals: worth it at batch 1
    a.record_proposer(0.060, 1)             # but each draft depth costs 60 ms
    assert a.choose(["r"], [4], 1) == [0]
