"""OutputProcessor without a model: the core's EngineCoreOutputs (written by hand here)
become RequestOutputs, with stop strings, logprob dicts, step stats, the children of a
request with n > 1, aborts and failures (uses the bundled model's tokenizer, no weights)."""
from __future__ import annotations

import pytest

from pagedllm.engine.metrics import IterationStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams


def _request(rid: str = "r", **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3, 4], SamplingParams(max_tokens=16, **params), [0], 100.0)


def _parent(op: OutputProcessor, n: int = 3, wait: bool = True) -> ParentRequest:
    parent, children = ParentRequest.fan_out(_request("p", n=n, seed=1), wait_for_prefix=wait)
    for i, (child, _) in enumerate(children):
        op.add_request(child, "prompt", parent, i)
    return parent


@pytest.fixture
def op(tokenizer):
    return OutputProcessor(tokenizer)


def test_stop_string_in_a_chunk_drops_the_tokens_after_it_and_asks_for_an_abort(op, tokenizer):
    ids = tokenizer.encode("The sky is blue. END and more words after", add_special_tokens=False)
    op.add_request(_request(stop=["END"]), "prompt")
    it = IterationStats()
    res = op.process_outputs([EngineCoreOutput("r", ids, scheduled_time=101.0, first_token_time=102.0)], it)
    (out,) = res.request_outputs
    kept = next(k for k in range(1, len(ids) + 1) if "END" in tokenizer.decode(ids[:k]))
    assert kept < len(ids)
    assert res.reqs_to_abort == ["r"] and res.reqs_to_add == []
    assert out.finished and out.request_id == "r" and out.prompt == "prompt"
    comp = out.outputs[0]
    assert comp.text == "The sky is blue. " and comp.token_ids == ids[:kept]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", "END")
    assert out.delta_text == "The sky is blue. " and out.delta_token_ids == ids[:kept]
    assert not op.request_states
    assert it.num_generation_tokens == kept and it.num_prompt_tokens == 4 and it.ttfts == [2.0]
    (fin,) = it.finished
    assert (fin.finish_reason, fin.num_generation_tokens, fin.num_prompt_tokens) == ("stop", kept, 4)
    assert fin.queue == 1.0 and fin.prefill == 1.0


def test_logprob_dicts_put_the_chosen_token_first_and_sum_its_logprobs(op, tokenizer):
    op.add_request(_request(logprobs=2), None)
    entries = [TokenLogprobs([7, 7, 9], [-0.5, -0.5, -1.5], 1), TokenLogprobs([11, 13, 7], [-3.0, -0.25, -1.0], 3)]
    res = op.process_outputs([EngineCoreOutput("r", [7, 11], new_logprobs=entries)], IterationStats())
    comp = res.request_outputs[0].outputs[0]
    text = tokenizer.decode
    assert comp.logprobs == [{7: Logprob(-0.5, 1, text([7])), 9: Logprob(-1.5, 2, text([9]))},
                             {11: Logprob(-3.0, 3, text([11])), 13: Logprob(-0.25, 1, text([13])),
                              7: Logprob(-1.0, 2, text([7]))}]
    assert comp.cumulative_logprob == pytest.approx(-3.5)
    assert op.token_text(13) == text([13])


def test_sequence_zero_releases_its_waiting_siblings_on_its_first_token(op):
    _parent(op, n=3, wait=True)
    nothing = op.process_outputs([EngineCoreOutput("0_p", [])], IterationStats())
    assert nothing.reqs_to_add == []
    res = op.process_outputs([EngineCoreOutput("0_p", [42])], IterationStats())
    assert [r.request_id for r in res.reqs_to_add] == ["1_p", "2_p"]
    assert [r.sampling_params.seed for r in res.reqs_to_add] == [2, 3]
    (out,) = res.request_outputs
    assert out.request_id == "p" and out.delta_index == 0 and not out.finished
    assert op.process_outputs([EngineCoreOutput("0_p", [43])], IterationStats()).reqs_to_add == []


def test_parent_finishes_with_all_n_sequences_by_index(op):
    _parent(op, n=3, wait=False)
    order = ["2_p", "0_p", "1_p"]
    outs = [op.process_outputs([EngineCoreOutput(cid, [50 + i], "length")], IterationStats()).request_outputs[0]
            for i, cid in enumerate(order)]
    assert [o.finished for o in outs] == [False, False, True]
    assert [o.delta_index for o in outs] == [2, 0, 1]
    assert [c.index for c in outs[0].outputs] == [2]
    assert [(c.index, c.token_ids) for c in outs[2].outputs] == [(0, [51]), (1, [52]), (2, [50])]
    assert not op.request_states and not op.parent_requests
    assert op.unfinished_request_ids() == []


def test_abort_of_a_parent_aborts_every_child(op):
    _parent(op, n=3, wait=True)
    op.add_request(_request("q"), None)
    assert op.unfinished_request_ids() == ["p", "q"]
    it = IterationStats()
    assert op.abort_requests(["p", "unknown"], it) == ["0_p", "1_p", "2_p", "unknown"]
    assert it.num_aborted == 3
    assert list(op.request_states) == ["q"] and not op.parent_requests


def test_abort_of_one_child_aborts_its_whole_parent(op):
    """A parent with a sequence gone could never finish: aborting a child's id aborts all."""
    _parent(op, n=3, wait=True)
    it = IterationStats()
    assert op.abort_requests(["1_p"], it) == ["0_p", "1_p", "2_p"]
    assert it.num_aborted == 3
    assert not op.request_states and not op.parent_requests


def test_a_failed_child_fails_its_parent_whole(op):
    _parent(op, n=3, wait=False)
    op.add_request(_request("q"), None)
    it = IterationStats()
    failed, siblings = op.fail_requests(["1_p", "q", "gone"], it)
    assert failed == ["p", "q"] and siblings == ["0_p", "2_p"]
    assert it.num_aborted == 2 and not op.parent_requests
    assert op.is_request_id_in_use("0_p") and not op.is_request_id_in_use("p")
