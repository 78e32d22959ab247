"""Structured outputs (grammar-constrained decoding with XGrammar, Dong et al. 2024): every
kind of constraint produces text that satisfies it on the bundled model; a constraint cut
by max_tokens ends with "length"; greedy constrained output does not depend on the batch
or on speculative decoding; bad constraints are rejected before anything is queued;
identical schemas compile once; a slow compile does not hold up other requests; and the
logits masking matches a reference. (Message round trips: tests/test_messages.py.)
"""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from engine_helpers import engine_core

from pagedllm import SamplingParams
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import StructuredOutputManager, apply_token_bitmask
from pagedllm.structured_output.bitmask import bitmask_to_bool, pack_bitmask, unpack_bitmask

PLAIN_KW = dict(max_model_len=1024, kv_cache_memory="512MiB")
SPEC_NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4})

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

JSON_PROMPTS = [
    "Describe a person as JSON with a name and an age.\n",
    'Examples: {"name": "Ann", "age": 31}\n{"name": "Bob", "age": 42}\n{"name": "Ann", "age": 31}\nNext:',
    "The capital of France is",
]


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def _greedy(max_tokens=48, **so_kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=_so(**so_kw) if so_kw else None)


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(**PLAIN_KW)


# --------------------------------------------------------------------------------------
# each kind of constraint, end to end
# --------------------------------------------------------------------------------------
def test_json_schema_outputs_validate(llm):
    params = [_greedy(json=PERSON),
              _greedy(json=json.dumps(PERSON)),
              SamplingParams(temperature=0.8, seed=7, max_tokens=48, structured_outputs=_so(json=PERSON))]
    outs = _gen(llm, JSON_PROMPTS, params)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 2, [(o.text, o.finish_reason) for o in outs]
    for o in stopped:
        value = json.loads(o.text)
        jsonschema.validate(value, PERSON)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_regex_choice_and_grammar(llm):
    ebnf = 'root ::= "(" digit digit? ", " digit digit? ")"\ndigit ::= [0-9]'
    choices = ["red", "green", "blue", "light grey"]
    prompts = ["My phone code is", "The colour of the sky is", "A point on the plane:", "Hello"]
    params = [_greedy(16, regex=r"[0-9]{3}-[a-z]{2}"), _greedy(16, choice=choices),
              _greedy(16, grammar=ebnf),
              SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_outputs=_so(choice=choices))]
    outs = _gen(llm, prompts, params)
    assert [o.finish_reason for o in outs] == ["stop"] * 4, [(o.text, o.finish_reason) for o in outs]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text), outs[0].text
    assert outs[1].text in choices and outs[3].text in choices
    assert re.fullmatch(r"\(\d\d?, \d\d?\)", outs[2].text), outs[2].text


def test_json_object(llm):
    outs = _gen(llm, ["Return a JSON object describing a cat.\n", "Settings as JSON:"],
                [_greedy(48, json_object=True, disable_any_whitespace=True),
                 _greedy(48, json_object=True)])
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, [(o.text, o.finish_reason) for o in outs]
    for o in stopped:
        assert isinstance(json.loads(o.text), dict), o.text


def test_max_tokens_inside_the_structure_ends_with_length(llm):
    out, = _gen(llm, [JSON_PROMPTS[0]], [_greedy(3, json=PERSON)])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
    assert out.text.lstrip().startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.text)


# --------------------------------------------------------------------------------------
# invariance: batch and speculative decoding
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_greedy_constrained_output_is_batch_and_spec_invariant(make_llm, llm, mixed_prompts):
    constrained = [_greedy(40, json=PERSON), _greedy(12, regex=r"[0-9]{3}-[a-z]{2}"),
                   _greedy(40, json=PERSON)]
    prompts = [JSON_PROMPTS[1], "My phone code is", JSON_PROMPTS[0]]
    alone = [_gen(llm, [p], [sp])[0].token_ids for p, sp in zip(prompts, constrained)]

    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    mixed = _gen(llm, mixed_prompts[:3] + prompts, [plain] * 3 + constrained)
    assert [o.token_ids for o in mixed[3:]] == alone
    # the unconstrained requests in the batch are not masked: they match their own runs
    assert [o.token_ids for o in mixed[:3]] == [_gen(llm, [p], [plain])[0].token_ids for p in mixed_prompts[:3]]

    spec = make_llm(**PLAIN_KW, speculative_config=SPEC_NGRAM)
    manager = engine_core(spec.llm_engine).structured_output
    drafted = []   # drafts verified under a grammar (k + 1 bitmask rows)
    real = manager.grammar_bitmask
    manager.grammar_bitmask = lambda sched: (drafted.extend(d for _, d in sched if d), real(sched))[1]
    try:
        outs = _gen(spec, [mixed_prompts[0]] + prompts, [plain] + constrained)
    finally:
        del manager.grammar_bitmask
    assert [o.token_ids for o in outs[1:]] == alone
    assert drafted


@pytest.mark.slow
def test_preempted_and_chunked_constrained_requests_keep_their_grammar(make_llm, llm, mixed_prompts):
    """A preempted request recomputes its tokens and goes on from where its matcher was;
    a prompt chunked over steps gets no bitmask row until its last chunk."""
    prompts = [JSON_PROMPTS[1], mixed_prompts[5], JSON_PROMPTS[0], mixed_prompts[9]]
    params = [_greedy(32, json=PERSON), _greedy(32, regex=r"[0-9]{3}-[a-z]{2}"), _greedy(32, json=PERSON),
              _greedy(32, json_object=True, disable_any_whitespace=True)]
    alone = [_gen(llm, [p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    small = make_llm(max_model_len=192, num_gpu_blocks_override=12, block_size=16, max_num_batched_tokens=48)
    sched = engine_core(small.llm_engine).scheduler
    before = sched.num_preemptions_total
    assert [c.token_ids for c in _gen(small, prompts, params)] == alone
    assert sched.num_preemptions_total > before


# --------------------------------------------------------------------------------------
# validation and the compile cache
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(json="not json"), "json is not valid JSON"),
    (dict(json="[1, 2]"), "must be an object or a boolean"),
    (dict(json={"type": 5}), "json is invalid"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "json is invalid"),
    (dict(regex="(ab"), "regex is invalid"),
    (dict(regex="[a-"), "regex is invalid"),
    (dict(grammar="root ::= foo"), "grammar is invalid"),
    (dict(grammar="garbage"), "grammar is invalid"),
])
def test_invalid_constraints_are_rejected_before_queueing(llm, kw, match):
    eng = llm.llm_engine
    with pytest.raises(ValueError, match=match) as e:
        llm.generate(["fine prompt", "another"], [_greedy(4), _greedy(4, **kw)], use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not eng.states and not engine_core(eng).scheduler.requests


@pytest.mark.parametrize("kw", [dict(regex="a", choice=["b"]), dict(), dict(json_object=False),
                                dict(choice=[]), dict(choice=["a", ""]), dict(json=[1]),
                                dict(regex=""), dict(json_object="yes")])
def test_bad_structured_outputs_params(kw):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        StructuredOutputsParams(**kw)
    assert e.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_identical_schemas_compile_once(llm):
    manager = engine_core(llm.llm_engine).structured_output
    schema = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"],
              "additionalProperties": False}
    before = manager.num_compiles
    outs = _gen(llm, ["Count:", "Number as JSON:", "How many?"], [_greedy(8, json=schema)] * 2
                + [_greedy(8, json=json.dumps(schema))])   # a dict and its JSON text: one key
    assert manager.num_compiles == before + 1
    _gen(llm, ["Again:"], [_greedy(8, json=schema)])
    assert manager.num_compiles == before + 1
    assert all(o.token_ids for o in outs)


def test_a_grammar_that_fails_to_compile_aborts_only_its_request(llm, monkeypatch):
    manager = engine_core(llm.llm_engine).structured_output

    def fail(kind, spec):
        raise RuntimeError("boom")

    monkeypatch.setattr(manager, "_compile", fail)
    outs = _gen(llm, ["My phone code is", "Hello"], [_greedy(4, regex="[0-9]{9}x"), _greedy(4)])
    assert [o.finish_reason for o in outs] == ["abort", "length"]
    assert outs[0].token_ids == [] and len(outs[1].token_ids) == 4
    monkeypatch.undo()
    out, = _gen(llm, ["My phone code is"], [_greedy(16, regex="[0-9]{9}x")])   # a failure is not cached
    assert out.finish_reason == "stop" and re.fullmatch("[0-9]{9}x", out.text)


def test_constraints_that_exclude_each_other_end_only_that_request(llm, caplog):
    """A grammar whose only continuation the request's other constraints forbid (a choice
    that is complete while min_tokens still bans EOS): every token is masked, and that
    request ends with finish_reason "abort", its text the grammar's so far, with a warning
    that says why; the request beside it is untouched."""
    conflict = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                              structured_outputs=_so(choice=["yes"]))
    with caplog.at_level("WARNING", logger="pagedllm"):
        outs = _gen(llm, ["Answer:", "Hello"], [conflict, _greedy(4)])
    assert outs[0].finish_reason == "abort" and outs[0].text.startswith("yes")
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    assert any("no token satisfies both its grammar" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------
# the scheduler without a model
# --------------------------------------------------------------------------------------
def test_compiling_request_waits_without_blocking_others(model_path):
    manager = StructuredOutputManager(model_path, 49152, [2])
    release = threading.Event()
    real_compile = manager._compile
    manager._compile = lambda kind, spec: (release.wait(30), real_compile(kind, spec))[1]
    sched = Scheduler(KVCacheManager(64, 4, False), max_num_batched_tokens=64, max_num_seqs=8,
                      max_model_len=64, structured_output=manager)
    try:
        sched.add_request(Request("g", [1, 2, 3], _greedy(8, regex="[0-9]+"), {2}))
        sched.add_request(Request("p", [4, 5, 6], _greedy(4), {2}))
        so = sched.schedule()
        assert list(so.num_scheduled_tokens) == ["p"] and so.grammar_bitmask is None
        assert [r.request_id for r in sched.waiting] == ["g"]
        sched.update_from_output(so, ModelRunnerOutput(["p"], [[9]]))
        release.set()
        manager.wait_for_compiles(30)
        # "g" is admitted now; "p" (unconstrained) keeps its drafts and has no bitmask row
        sched.requests["p"].spec_token_ids = [7, 8]
        so = sched.schedule()
        assert so.num_scheduled_tokens == {"p": 3, "g": 3}
        gb = so.grammar_bitmask
        assert gb.req_first_row == {"g": 0} and gb.num_rows == 1 and gb.num_words == 49152 // 32
        allowed = bitmask_to_bool(unpack_bitmask(gb), 49152)[0]
        digits = [t for t in range(49152) if allowed[t]]
        assert digits and 2 not in digits   # digits only, and no EOS before one digit
        # one digit accepted; its drafts: a digit, EOS, then 5 after EOS, which is cut
        digit = digits[0]
        sched.update_from_output(so, ModelRunnerOutput(["p", "g"], [[9], [digit]]))
        sched.requests["g"].spec_token_ids = [digit, 2, 5]
        so = sched.schedule()
        assert so.scheduled_spec_decode_tokens["g"] == [digit, 2]
        gb = so.grammar_bitmask
        assert gb.req_first_row == {"g": 0} and gb.num_rows == 3
        rows = bitmask_to_bool(unpack_bitmask(gb), 49152)
        assert rows[0, digit] and rows[0, 2] and rows[1, 2] and not rows[1, 5]
        assert rows[2].all()   # past EOS the grammar is terminated: the row is discarded anyway
        assert manager._grammars["g"].num_processed_tokens == 1   # rolled back after filling
        outs = sched.update_from_output(so, ModelRunnerOutput(["g"], [[digit, 2]]))
        assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [("g", "stop", [digit, 2])]
        assert "g" not in manager._grammars
    finally:
        release.set()
        sched.finish_requests(list(sched.requests))
        manager.shutdown()


# --------------------------------------------------------------------------------------
# masking
# --------------------------------------------------------------------------------------
def _reference_mask(logits, bitmask, rows):
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [None, [0, 3], []])
def test_apply_token_bitmask_matches_reference(rows):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 4), dtype=torch.int32, generator=g)
    expect = _reference_mask(logits, bitmask, range(5) if rows is None else rows)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expect)
    allowed = bitmask_to_bool(bitmask, 100)
    assert torch.equal(torch.isfinite(_reference_mask(logits, bitmask, range(5))), allowed)
    back = unpack_bitmask(pack_bitmask(bitmask, {"a": 0}))
    assert torch.equal(back, bitmask)


def test_runner_maps_bitmask_rows_by_request():
    """The runner's logits rows are in its own order (decodes first) with k + 1 rows per
    speculative request; each gets its own bitmask row."""
    from pagedllm.worker.model_runner import ModelRunner

    g = torch.Generator().manual_seed(1)
    bm = torch.randint(-2**31, 2**31 - 1, (4, 2), dtype=torch.int32, generator=g)
    gb = pack_bitmask(bm, {"s": 0, "c": 3})   # "s": 3 rows (2 drafts), "c": 1 row
    so = SchedulerOutput([], None, {"c": 1, "u": 1, "s": 3}, 5, grammar_bitmask=gb)
    logits = torch.randn(5, 64, generator=g)
    got = logits.clone()
    ModelRunner._apply_grammar_bitmask(None, got, ["u", "c", "s", "s", "s"], so)
    expect = logits.clone()
    for dst, src in [(1, 3), (2, 0), (3, 1), (4, 2)]:
        expect[dst] = _reference_mask(logits[dst:dst + 1], bm[src:src + 1], [0])[0]
    assert torch.equal(got, expect)
