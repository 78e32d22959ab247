"""Scheduler invariants with a fake model runner (no model needed).

The fake runner knows only what the SchedulerOutput deltas tell it (new requests once,
then new block ids and computed-token counts), as the real ModelRunner, and checks at
every step that its rebuilt block tables and token positions equal the scheduler's own;
the token it samples depends only on the position, so a request's output is the same
whatever the batching, chunking or preemption.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.messages import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv

EOS = 2


def fake_token(position: int) -> int:
    """The token the fake model samples after ``position + 1`` tokens (never EOS)."""
    return 10 + (position * 7919) % 997


def expected_output(prompt_len: int, max_tokens: int) -> list[int]:
    return [fake_token(prompt_len + i - 1) for i in range(max_tokens)]


class DeltaState:
    """A runner's knowledge, rebuilt from SchedulerOutput deltas only."""

    def __init__(self):
        self.reqs: dict[str, dict] = {}

    def apply(self, so) -> list[SimpleNamespace]:
        """Apply ``so``'s deltas; returns what each scheduled request computes this step."""
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs, "a known request was sent as new"
            self.reqs[nr.req_id] = {"tokens": list(nr.prompt_token_ids), "prompt": len(nr.prompt_token_ids),
                                    "blocks": list(nr.block_ids[0]), "computed": nr.num_computed_tokens}
        c = so.scheduled_cached_reqs
        for rid, resumed, blocks, computed in zip(c.req_ids, c.resumed_from_preemption,
                                                  c.new_block_ids, c.num_computed_tokens):
            st = self.reqs[rid]
            st["blocks"] = list(blocks[0]) if resumed else st["blocks"] + list(blocks[0])
            st["computed"] = computed
        views = []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start, end = st["computed"], st["computed"] + n
            views.append(SimpleNamespace(
                req_id=rid, num_computed_tokens=start, num_scheduled_tokens=n,
                token_ids=st["tokens"][start:end], block_ids=list(st["blocks"]),
                sample=end >= len(st["tokens"]), num_output_tokens=len(st["tokens"]) - st["prompt"]))
        return views

    def update(self, sched: Scheduler, so, sampled: dict[str, int]):
        """Feed the sampled tokens to the scheduler and to this state; returns the outputs."""
        for rid, tok in sampled.items():
            self.reqs[rid]["tokens"].append(tok)
        return sched.update_from_output(so, runner_output(sampled))


def runner_output(sampled: dict[str, int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(list(sampled), [[t] for t in sampled.values()])


class FakeRunner:
    """Executes SchedulerOutputs, checking them against the request state."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv = sched.kv
        self.state = DeltaState()
        self.cache: dict[str, list[int]] = {}     # tokens "in the KV cache" per request
        self.outputs: dict[str, list[int]] = {}
        self.batches: list[list[str]] = []

    def execute(self, so) -> dict[str, int]:
        sched = self.sched
        views = self.state.apply(so)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(views) <= sched.max_num_seqs
        assert len(sched.running) <= sched.max_num_seqs
        for rid in so.finished_req_ids:
            self.cache.pop(rid, None)
        held: dict[int, str] = {}
        out = {}
        for sr in views:
            assert sr.num_scheduled_tokens >= 1
            req = sched.requests[sr.req_id]
            cache = self.cache.setdefault(sr.req_id, [])
            start = sr.num_computed_tokens
            assert start == req.num_computed_tokens
            if start != len(cache):
                # Only a (re)admission may start elsewhere than where the cache ends: after
                # a preemption from 0, or from a prefix-cache hit of whole blocks.
                assert req.num_preemptions > 0 or not cache, "a step skipped or repeated tokens"
                assert start == 0 or (self.kv.enable_caching and start % self.kv.block_size == 0)
            end = start + sr.num_scheduled_tokens
            assert sr.token_ids == req.all_token_ids[start:end]
            cache[:] = req.all_token_ids[:end]
            assert sr.block_ids == self.kv.get_block_ids(sr.req_id), "deltas lost a block"
            assert len(sr.block_ids) >= cdiv(end, self.kv.block_size)
            assert end <= sched.max_model_len
            assert sr.sample == (end == req.num_tokens)
            if not self.kv.enable_caching:
                for b in sr.block_ids:
                    assert held.setdefault(b, sr.req_id) == sr.req_id, "block shared by two requests"
            if sr.sample:
                out[sr.req_id] = fake_token(end - 1)
        self.batches.append([sr.req_id for sr in views])
        return out

    def step(self):
        so = self.sched.schedule()
        for o in self.state.update(self.sched, so, self.execute(so)):
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return so

    def run(self, max_steps: int = 20_000) -> dict[str, list[int]]:
        while self.sched.has_unfinished_requests():
            assert len(self.batches) < max_steps, "the scheduler made no progress"
            self.step()
        return self.outputs

def make_sched(num_blocks=64, block_size=16, budget=2048, max_seqs=256, max_len=4096,
               chunked=True, caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, budget, max_seqs, max_len, chunked)


def mkreq(rid, n_prompt, max_tokens, seed=0, **sp) -> Request:
    rng = random.Random(hash((rid, seed)) & 0xFFFF)
    toks = [rng.randrange(3, 1000) for _ in range(n_prompt)]
    return Request(rid, toks, SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids={EOS})


def scheduled_ids(so) -> list[str]:
    return list(so.num_scheduled_tokens)


def check_all_done(sched: Scheduler, reqs, outputs):
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH, (r.request_id, r.status)
        assert outputs[r.request_id] == expected_output(r.num_prompt_tokens, r.sampling_params.max_tokens)
        assert r.output_token_ids == outputs[r.request_id]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.running and not sched.waiting and not sched.requests
    assert sched.kv.req_blocks == {}


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("budget,max_seqs,num_blocks,chunked", [
    (37, 5, 20, True),       # tight budget, few seqs, small cache: chunking + preemption
    (64, 3, 12, True),
    (512, 64, 400, True),    # roomy: no preemption
    (200, 8, 40, False),     # no chunked prefill: prompts go whole
])
def test_random_workload_respects_limits(budget, max_seqs, num_blocks, chunked, caching):
    max_len = min(160, num_blocks * 8)       # one request always fits the cache alone
    sched = make_sched(num_blocks=num_blocks, block_size=8, budget=budget, max_seqs=max_seqs,
                       max_len=max_len, chunked=chunked, caching=caching)
    runner = FakeRunner(sched)
    rng = random.Random(budget * 1000 + num_blocks)
    pending = []
    for i in range(40):
        n_prompt = rng.randrange(1, min(budget, max_len - 40))
        r = mkreq(f"r{i}", n_prompt, rng.randrange(1, 40))
        if i % 5 == 0 and n_prompt > 30:     # a shared 24-token prefix: prefix-cache hits
            r = Request(r.request_id, list(range(500, 524)) + r.prompt_token_ids[24:],
                        r.sampling_params, {EOS})
        pending.append(r)
    reqs = list(pending)
    # Requests arrive over time, 0 to 3 per step.
    while pending or sched.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                sched.add_request(pending.pop(0))
        runner.step()
        assert len(runner.batches) < 20_000
    check_all_done(sched, reqs, runner.outputs)
    assert max(len(b) for b in runner.batches) <= max_seqs
    if num_blocks <= 20:
        assert sched.num_preemptions_total > 0, "the small cache should have forced preemption"
    if num_blocks >= 400:
        assert sched.num_preemptions_total == 0
    if caching:
        assert sched.kv.stats.hits > 0


def test_budget_is_filled_by_chunks_then_decodes():
    sched = make_sched(budget=32)
    a, b = mkreq("a", 40, 3), mkreq("b", 20, 3)
    sched.add_request(a)
    sched.add_request(b)
    st = DeltaState()
    so = sched.schedule()
    assert [(s.req_id, s.num_scheduled_tokens, s.sample) for s in st.apply(so)] == [("a", 32, False)]
    assert so.num_prefill_tokens == 32
    st.update(sched, so, {})
    so = sched.schedule()
    # a finishes its prompt (8 tokens), b's whole 20-token prompt fits the 24 left.
    assert [(s.req_id, s.num_computed_tokens, s.num_scheduled_tokens, s.sample)
            for s in st.apply(so)] == [("a", 32, 8, True), ("b", 0, 20, True)]
    assert [nr.req_id for nr in so.scheduled_new_reqs] == ["b"]     # a was sent whole before
    assert so.num_prefill_tokens == 28 and so.num_decode_tokens == 0
    st.update(sched, so, {"a": 11, "b": 12})
    so = sched.schedule()
    assert [(s.req_id, s.token_ids) for s in st.apply(so)] == [("a", [11]), ("b", [12])]
    assert not so.scheduled_new_reqs and so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert so.num_decode_tokens == 2 and so.num_prefill_tokens == 0
    sched.finish_requests(["a", "b"])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_prefix_cache_stats_count_each_admission_once():
    """A request that waits (here: what is left of its prompt after the hit does not fit
    what 20 decodes leave of the budget, without chunked prefill) is looked up at every
    step but counted in the stats once, when admitted: hits equal the requests' own
    ``num_cached_tokens``."""
    sched = make_sched(budget=64, chunked=False)
    runner = FakeRunner(sched)
    p = mkreq("p", 16, 1)
    sched.add_request(p)
    runner.run()                                      # p's full block is now cached
    decoders = [mkreq(f"a{i}", 2, 6) for i in range(20)]
    for a in decoders:
        sched.add_request(a)
    runner.step()
    b = Request("b", p.prompt_token_ids + list(range(600, 648)), SamplingParams(max_tokens=2), {EOS})
    sched.add_request(b)
    waited = 0
    while sched.has_unfinished_requests():
        runner.step()
        waited += b.status == RequestStatus.WAITING
    assert waited >= 3                                # b was looked up (and refused) at each of these
    assert b.num_cached_tokens == 16
    st = sched.kv.stats
    assert (st.requests, st.queries, st.hits) == (22, 16 + 20 * 2 + 64, 16)
    assert st.hits == sum(r.num_cached_tokens for r in [p, b, *decoders])


def test_max_num_seqs_limits_admission():
    sched = make_sched(max_seqs=2)
    reqs = [mkreq(f"r{i}", 5, 4) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.step()
    assert runner.batches[0] == ["r0", "r1"] and len(sched.waiting) == 3
    runner.run()
    assert max(len(b) for b in runner.batches) == 2
    check_all_done(sched, reqs, runner.outputs)


def test_preemption_picks_the_most_recently_admitted():
    # 4 blocks of 4 tokens. Three 4-token prompts take one block each; at the first decode
    # each needs a second block: a gets the last free one, b cannot grow, so c (the most
    # recently admitted) is preempted and its block goes to b.
    sched = make_sched(num_blocks=4, block_size=4, caching=False)
    a, b, c = mkreq("a", 4, 6), mkreq("b", 4, 6), mkreq("c", 4, 6)
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner(sched)
    so = runner.step()
    assert scheduled_ids(so) == ["a", "b", "c"] and so.num_preempted == 0
    d = mkreq("d", 1, 1)
    sched.add_request(d)
    so = runner.step()
    assert so.num_preempted == 1
    assert scheduled_ids(so) == ["a", "b"]    # d is not admitted this step
    assert c.status == RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.output_token_ids == [fake_token(3)]
    assert list(sched.waiting) == [c, d] and sched.running == [a, b]
    assert sched.kv.get_block_ids("c") == []
    assert sched.num_preemptions_total == 1 and sched.stats().num_preemptions_total == 1
    so = runner.step()
    while "c" not in so.num_scheduled_tokens:
        so = runner.step()
    # c comes back as a known request, resumed, with a whole new block table
    c_idx = so.scheduled_cached_reqs.req_ids.index("c")
    assert so.scheduled_cached_reqs.resumed_from_preemption[c_idx]
    assert so.scheduled_cached_reqs.new_block_ids[c_idx] == sched.kv.get_group_block_ids("c")
    runner.run()
    check_all_done(sched, [a, b, c, d], runner.outputs)


def test_preemption_victims_are_the_latest_admitted():
    sched = make_sched(num_blocks=7, block_size=4, caching=False)
    reqs = [mkreq(f"r{i}", 3 + i, 14) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    victims = []
    while sched.has_unfinished_requests():
        before = list(sched.running)
        so = runner.step()
        if so.num_preempted:
            gone = [r for r in before if r.status == RequestStatus.PREEMPTED]
            assert len(gone) == so.num_preempted
            # The victims are the tail of the running list, i.e. the latest admitted.
            assert before[len(before) - len(gone):] == gone
            victims += [r.request_id for r in gone]
    assert victims and "r0" not in victims
    check_all_done(sched, reqs, runner.outputs)


def test_requests_the_processor_would_reject_are_assertion_errors():
    """Validation is the front end's (Processor's, tested in test_llm_errors); the
    scheduler asserts the invariants it relies on instead of checking them again."""
    sched = make_sched(max_len=64)
    with pytest.raises(AssertionError):
        sched.add_request(mkreq("long", 60, 5))
    sched.add_request(mkreq("ok", 59, 5))    # exactly 64 is allowed
    with pytest.raises(AssertionError):
        sched.add_request(mkreq("ok", 3, 1))
    out = FakeRunner(sched).run()
    assert out == {"ok": expected_output(59, 5)}
    sched = make_sched(budget=32, chunked=False)
    with pytest.raises(AssertionError):
        sched.add_request(mkreq("a", 33, 1))
    sched.add_request(mkreq("b", 32, 1))
    assert FakeRunner(sched).run() == {"b": expected_output(32, 1)}


def test_eos_stop_tokens_and_min_tokens():
    sched = make_sched()
    a = mkreq("a", 5, 10)
    b = mkreq("b", 5, 10, stop_token_ids=[77])
    c = mkreq("c", 5, 10, ignore_eos=True)
    d = mkreq("d", 5, 10, min_tokens=2)
    for r in (a, b, c, d):
        sched.add_request(r)
    st = DeltaState()
    so = sched.schedule()
    st.apply(so)
    outs = st.update(sched, so, {"a": EOS, "b": 77, "c": EOS, "d": 5})
    assert {o.request_id: (o.finish_reason, o.stop_reason) for o in outs} == {
        "a": ("stop", None), "b": ("stop", 77), "c": (None, None), "d": (None, None)}
    assert sched.kv.get_block_ids("a") == [] and sched.kv.get_block_ids("b") == []
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"}
    assert scheduled_ids(so) == ["c", "d"]
    assert st.apply(so)[1].num_output_tokens == 1       # the runner still bans EOS for d
    outs = st.update(sched, so, {"c": 5, "d": 6})
    so = sched.schedule()
    assert st.apply(so)[1].num_output_tokens == 2       # min_tokens reached: EOS allowed
    outs = st.update(sched, so, {"c": 5, "d": EOS})
    assert {o.request_id: o.finish_reason for o in outs} == {"c": None, "d": "stop"}
    sched.finish_requests(["c"])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.has_unfinished_requests()


def test_max_tokens_and_max_model_len_finish_with_length():
    sched = make_sched(max_len=12)
    a = mkreq("a", 4, 3)
    b = Request("b", [5] * 4, SamplingParams(max_tokens=8), {EOS})   # up to max_model_len
    sched.add_request(a)
    sched.add_request(b)
    out = FakeRunner(sched).run()
    assert len(out["a"]) == 3 and a.finish_reason == "length"
    assert len(out["b"]) == 8 and b.num_tokens == 12 and b.finish_reason == "length"


def test_abort_frees_waiting_and_running_requests():
    sched = make_sched(num_blocks=8, max_seqs=1)
    a, b = mkreq("a", 20, 5), mkreq("b", 20, 5)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    assert scheduled_ids(so) == ["a"]
    done = sched.finish_requests(["a", "b", "unknown"])
    assert [r.request_id for r in done] == ["a", "b"]
    assert a.finish_reason == b.finish_reason == "abort"
    # The step that was in flight when a was aborted is ignored.
    assert sched.update_from_output(so, runner_output({"a": 5})) == []
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished_requests()


def test_preempted_request_grown_past_the_budget_resumes_without_chunking():
    """Without chunked prefill a prompt must fit the token budget to be admitted, but a
    running request keeps growing: once preempted with prompt + output > budget, its
    recomputation must still be scheduled (else the engine spins forever)."""
    sched = make_sched(num_blocks=10, block_size=4, budget=16, max_len=40, chunked=False,
                       caching=False)
    a, b = mkreq("a", 12, 20), mkreq("b", 12, 20)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    runner.run(max_steps=300)
    assert sched.num_preemptions_total > 0
    check_all_done(sched, [a, b], runner.outputs)
