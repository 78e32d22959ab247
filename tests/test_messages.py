"""The seams' contracts without a model: every message survives msgspec encoding (so a
core or a worker could sit in another process), the Processor owns validation, and the
runner's persistent input batch keeps rows consistent across adds, removals and appends."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.processor import Processor
from pagedllm.errors import InvalidParameterError
from pagedllm.messages import (CachedRequestData, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                               GrammarBitmask, ModelRunnerOutput, SchedulerOutput, SchedulerStats)
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.worker.input_batch import CachedRequestState, InputBatch


def roundtrip(obj, typ):
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=typ)


def test_engine_core_messages_roundtrip():
    sp = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=9, stop=["\n\n", "END"],
                        stop_token_ids=[7], cache_salt="tenant-a", min_tokens=2)
    req = EngineCoreRequest("r1", [1, 2, 3], sp, [0, 2], 1700000000.5)
    back = roundtrip(req, EngineCoreRequest)
    assert back == req
    assert back.sampling_params.stop_strings == ["\n\n", "END"]
    outs = EngineCoreOutputs(
        [EngineCoreOutput("r1", [5, 6], "stop", 6, num_cached_tokens=16, scheduled_time=1.0,
                          first_token_time=2.0, finished_time=3.0, num_preemptions=1)],
        SchedulerStats(num_running=1, kv_cache_usage=0.25, step_num_reqs=1, step_num_decode_tokens=1),
        failed_request_ids=["r2"], error="RuntimeError: boom")
    assert roundtrip(outs, EngineCoreOutputs) == outs


def test_scheduler_output_roundtrips_and_sends_deltas():
    sched = Scheduler(KVCacheManager(32, 4, True), max_num_batched_tokens=64, max_num_seqs=8,
                      max_model_len=64)
    sched.add_request(Request("a", list(range(10, 20)), SamplingParams(max_tokens=4, seed=1), {2}))
    so = sched.schedule()
    back = roundtrip(so, SchedulerOutput)
    assert back == so
    assert [nr.req_id for nr in back.scheduled_new_reqs] == ["a"]
    assert back.scheduled_new_reqs[0].block_ids == sched.kv.get_group_block_ids("a")
    sched.update_from_output(so, ModelRunnerOutput(["a"], [[42]]))
    so = sched.schedule()   # 11 tokens in 3 blocks of 4: no new block, only deltas
    back = roundtrip(so, SchedulerOutput)
    assert not back.scheduled_new_reqs
    assert back.scheduled_cached_reqs.req_ids == ["a"]
    assert back.scheduled_cached_reqs.new_block_ids == [[[]]]
    assert back.scheduled_cached_reqs.num_computed_tokens == [10]
    assert back.num_scheduled_tokens == {"a": 1}


@pytest.mark.parametrize("so", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "string"}', disable_any_whitespace=True),
    StructuredOutputsParams(regex="[0-9]+"), StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='root ::= "a"'), StructuredOutputsParams(json_object=True)])
def test_structured_outputs_roundtrip(so):
    req = EngineCoreRequest("r1", [1, 2], SamplingParams(max_tokens=4, structured_outputs=so), [2], 1.0)
    back = roundtrip(req, EngineCoreRequest)
    assert back == req and back.sampling_params.structured_outputs.kind == so.kind
    out = SchedulerOutput([], CachedRequestData(), {"r1": 3}, 3, {"r1": [5, 6]},
                          grammar_bitmask=GrammarBitmask({"r1": 0}, 3, 2, bytes(range(24))))
    assert roundtrip(out, SchedulerOutput) == out


class _Tok:
    def encode(self, text):
        return [ord(c) % 100 for c in text]


def _processor(chunked=True):
    return Processor(_Tok(), vocab_size=100, max_model_len=32, eos_token_ids={2},
                     max_num_batched_tokens=16, enable_chunked_prefill=chunked)


def test_processor_owns_validation():
    p = _processor()
    req, text = p.process("x", "hello", SamplingParams(max_tokens=None))
    assert text == "hello" and req.prompt_token_ids == _Tok().encode("hello")
    assert req.sampling_params.max_tokens == 32 - 5 and req.eos_token_ids == [2]
    with pytest.raises(InvalidParameterError) as e:
        p.process("x", "hello", SamplingParams(max_tokens=28))
    assert e.value.param == "max_tokens" and "max_model_len (32)" in str(e.value)
    with pytest.raises(InvalidParameterError) as e:
        p.process("x", [1] * 32, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as e:
        p.process("x", [1, 2], SamplingParams(stop_token_ids=[100]))
    assert e.value.param == "stop_token_ids"
    # without chunked prefill a prompt must fit one step's budget (16 tokens)
    p.process("x", [1] * 17, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidParameterError) as e:
        _processor(chunked=False).process("x", [1] * 17, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt" and "max_num_batched_tokens" in str(e.value)


def _state(rid, tokens, blocks, **sp):
    return CachedRequestState(rid, tokens, SamplingParams(max_tokens=8, **sp), [2], [blocks], 0, None)


def test_input_batch_rows_follow_deltas():
    b = InputBatch(max_num_reqs=3, max_model_len=16, max_num_blocks_per_req=4)
    a = _state("a", [5, 6, 7], [9], temperature=0.5, top_k=3)
    c = _state("c", [1, 2], [4], min_tokens=2, stop_token_ids=[11])
    ra, rc = b.add(a), b.add(c)
    assert len(b) == 2 and ra != rc
    assert b.token_ids[ra, :3].tolist() == [5, 6, 7] and b.num_tokens[ra] == 3
    assert b.temperature[ra] == np.float32(0.5) and b.top_k[ra] == 3
    assert b.stop_ids[rc] == [2, 11] and ra not in b.stop_ids
    b.append_tokens(np.array([ra, rc]), np.array([70, 20]))
    b.append_block_ids(ra, [[3]])
    assert b.token_ids[ra, :4].tolist() == [5, 6, 7, 70] and b.num_tokens[rc] == 3
    assert b.block_table[ra, : b.num_blocks[ra]].tolist() == [9, 3]
    # out of the batch (preempted or unscheduled): the state keeps what the row had
    b.remove("a", a)
    assert a.token_ids == [5, 6, 7, 70] and a.block_ids == [[9, 3]] and len(b) == 1
    a.block_ids = [[8]]   # resumed after preemption with a new block table
    ra2 = b.add(a)
    assert b.token_ids[ra2, :4].tolist() == [5, 6, 7, 70]
    assert b.block_table[ra2, : b.num_blocks[ra2]].tolist() == [8]
    b.add(_state("d", [1], [0]))
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        b.add(_state("e", [1], [1]))
