"""ParentRequest without a model: the fan-out of a request with n > 1 into child requests
(ids, seeds, params), the pending release, the assembly of the caller's outputs, and the
parent-wide failure."""
from __future__ import annotations

import pytest

from pagedllm.engine.parallel_sampling import ParentRequest, child_seed
from pagedllm.messages import EngineCoreRequest
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams


def _request(n: int = 3, seed: int | None = 10, **kw) -> EngineCoreRequest:
    sp = SamplingParams(n=n, seed=seed, max_tokens=4, temperature=0.8, **kw)
    return EngineCoreRequest("p", [1, 2, 3], sp, [0], 100.0)


def _comp(index: int, text: str = "") -> CompletionOutput:
    return CompletionOutput(index, text, [], "length", None, None, None)


def test_child_seed_adds_the_index_and_wraps_to_int64():
    assert child_seed(None, 2) is None
    assert child_seed(10, 0) == 10 and child_seed(10, 2) == 12
    assert child_seed(2**63 - 1, 1) == -2**63
    assert child_seed(2**63 - 2, 3) == -2**63 + 1
    assert child_seed(-1, 1) == 0


@pytest.mark.parametrize("wait", [False, True])
def test_fan_out_makes_n_children_with_their_own_seed(wait):
    req = _request(n=3, seed=2**63 - 2, best_of=3)
    parent, children = ParentRequest.fan_out(req, wait_for_prefix=wait)
    assert parent.request_id == "p" and parent.child_ids == ["0_p", "1_p", "2_p"]
    assert [c.request_id for c, _ in children] == parent.child_ids
    assert [send for _, send in children] == ([True, False, False] if wait else [True] * 3)
    assert [c.sampling_params.seed for c, _ in children] == [2**63 - 2, 2**63 - 1, -2**63]
    for child, _ in children:
        sp = child.sampling_params
        assert (sp.n, sp.best_of, sp.temperature, sp.max_tokens) == (1, None, 0.8, 4)
        assert child.prompt_token_ids == [1, 2, 3] and child.arrival_time == 100.0
    assert req.sampling_params.n == 3 and req.request_id == "p"   # the caller's request is unchanged
    assert [c.request_id for c in parent.pending] == (["1_p", "2_p"] if wait else [])


def test_take_pending_releases_once_and_skips_aborted_children():
    parent, _ = ParentRequest.fan_out(_request(n=3), wait_for_prefix=True)
    assert [c.request_id for c in parent.take_pending({"0_p", "2_p"})] == ["2_p"]
    assert parent.take_pending({"0_p", "1_p", "2_p"}) == [] and parent.pending == []


def test_abort_drops_the_waiting_children():
    parent, _ = ParentRequest.fan_out(_request(n=2), wait_for_prefix=True)
    parent.abort()
    assert parent.take_pending({"0_p", "1_p"}) == []


def test_outputs_carry_one_sequence_until_all_are_finished():
    parent = ParentRequest("p", 3)
    running = _comp(1, "a")
    assert parent.add_completion(1, running, False) == ([running], False)
    done = {i: _comp(i, str(i)) for i in range(3)}
    assert parent.add_completion(2, done[2], True) == ([done[2]], False)
    assert parent.add_completion(0, done[0], True) == ([done[0]], False)
    outputs, finished = parent.add_completion(1, done[1], True)
    assert finished and outputs == [done[0], done[1], done[2]]


def test_a_failed_child_names_its_alive_siblings():
    parent = ParentRequest("p", 3)
    assert parent.alive_children({"0_p", "2_p", "q"}) == ["0_p", "2_p"]
    assert parent.alive_children(set()) == []
