"""AsyncLLM when the engine fails: a failed step fails only its requests; repeated
failures, or an error outside a step, kill the engine, which fails every open stream and
makes /health and new requests answer 503 instead of hanging. A fake LLMEngine stands in
for the model (these are properties of the engine thread, not of the model)."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine import async_llm
from pagedllm.engine.async_llm import MAX_CONSECUTIVE_STEP_FAILURES, AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.sampling_params import SamplingParams


class FakeEngine:
    """LLMEngine's surface as AsyncLLM uses it. ``step_impl`` is what a step does; by
    default each step finishes every request."""

    def __init__(self, args, stat_loggers=None, log_stats=True):
        self.config = SimpleNamespace(model_path="/fake/model")
        self.model_name, self.max_model_len, self.tokenizer = "fake", 64, None
        self.core = SimpleNamespace()
        self.states: dict[str, str] = {}
        self.step_impl = self.finish_all
        self.abort_impl = None
        self.aborted: list[list[str]] = []   # each abort_request call's ids
        self.stat_loggers = []

    def finish_all(self):
        time.sleep(0.01)
        done = [SimpleNamespace(request_id=rid, finished=True) for rid in self.states]
        self.states.clear()
        return done

    def process(self, request_id, prompt, params, arrival_time=None, processor=None):
        return SimpleNamespace(request_id=request_id), prompt

    def tokenizer_copy(self):
        return None, None

    def check_health(self):
        pass

    def add_processed(self, req, text):
        self.states[req.request_id] = text

    def has_unfinished_requests(self):
        return bool(self.states)

    def unfinished_request_ids(self):
        return list(self.states)

    def step(self):
        return self.step_impl()

    def abort_request(self, request_ids):
        if self.abort_impl is not None:
            self.abort_impl()
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.aborted.append(request_ids)
        for rid in request_ids:
            self.states.pop(rid, None)

    def reset_prefix_cache(self):
        return 0

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None,
                            chat_template_kwargs=None, tools=None, tokenizer=None):
        return [1, 2, 3]

    def shutdown(self):
        pass


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(async_llm, "LLMEngine", FakeEngine)
    eng = AsyncLLM(EngineArgs(engine_process=False))   # the fake steps in this process
    yield eng
    eng.shutdown()


def _raise(msg):
    def f():
        raise RuntimeError(msg)
    return f


async def _run(eng: AsyncLLM, rid: str):
    """Last output of one request, or the exception its stream raised."""
    stream = await eng.add_request(rid, "hi", SamplingParams(max_tokens=4))
    try:
        last = None
        async for out in stream:
            last = out
        return last
    except Exception as e:  # noqa: BLE001
        return e


def test_failed_step_fails_its_requests_and_engine_keeps_serving(engine):
    fails = iter([True])

    def step():
        if next(fails, False):
            raise RuntimeError("bad batch")
        return engine.engine.finish_all()

    engine.engine.step_impl = step

    async def go():
        first = await _run(engine, "a")
        await engine.check_health()
        second = await _run(engine, "b")
        return first, second

    first, second = asyncio.run(go())
    assert isinstance(first, RuntimeError) and "bad batch" in str(first)
    assert second.request_id == "b" and second.finished
    assert engine._dead is None and not engine._streams


def test_repeated_step_failures_kill_the_engine(engine):
    engine.engine.step_impl = _raise("device error")

    async def go():
        errs = [await _run(engine, f"r{i}") for i in range(MAX_CONSECUTIVE_STEP_FAILURES)]
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "hi", SamplingParams())
        with pytest.raises(EngineDeadError):
            await engine.reset_prefix_cache()
        return errs

    errs = asyncio.run(go())
    assert all(type(e) is RuntimeError for e in errs[:-1]), errs
    assert isinstance(errs[-1], EngineDeadError) and "device error" in str(errs[-1])
    engine._thread.join(5)
    assert not engine._thread.is_alive() and isinstance(engine._dead, RuntimeError)


def test_engine_death_fails_open_streams_and_http_answers_503(engine):
    """The step fails and so does the recovery: the loop dies. Both requests in flight
    fail (not hang), then /health and new requests answer 503 with a JSON error."""
    go_ahead = threading.Event()

    def step():
        go_ahead.wait(10)
        raise RuntimeError("step exploded")

    engine.engine.step_impl = step
    engine.engine.abort_impl = _raise("recovery exploded")
    app = build_app(engine)

    async def go():
        tasks = [asyncio.ensure_future(_run(engine, rid)) for rid in ("a", "b")]
        while len(engine._streams) < 2:
            await asyncio.sleep(0.01)
        go_ahead.set()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            health = await c.get("/health")
            completion = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            chat = await c.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            reset = await c.post("/reset_prefix_cache")
        return outs, health, completion, chat, reset

    outs, health, completion, chat, reset = asyncio.run(go())
    assert all(isinstance(o, EngineDeadError) and "recovery exploded" in str(o) for o in outs), outs
    assert health.status_code == 503
    for r in (completion, chat, reset):
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "died" in err["message"]
    assert not engine._streams


def test_fail_all_fails_every_stream_and_aborts_them_in_one_message(engine):
    release = threading.Event()

    def step():
        release.wait(10)
        return []

    engine.engine.step_impl = step

    async def go():
        tasks = [asyncio.ensure_future(_run(engine, rid)) for rid in ("a", "b")]
        while len(engine._streams) < 2:
            await asyncio.sleep(0.01)
        assert engine.fail_all(RuntimeError("draining")) == 2
        release.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    outs = asyncio.run(go())
    assert all(isinstance(o, RuntimeError) and str(o) == "draining" for o in outs), outs
    deadline = time.monotonic() + 5
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.engine.aborted == [["a", "b"]]
    assert engine._dead is None and not engine._streams


def test_an_unknown_inbox_message_kills_the_engine(engine):
    """The inbox carries typed messages only; anything else is a bug that stops the loop
    (every waiter then gets EngineDeadError) instead of being ignored."""
    engine._inbox.put(("abort", "a"))
    engine._thread.join(5)
    assert not engine._thread.is_alive()
    assert isinstance(engine._dead, TypeError) and "unknown inbox message" in str(engine._dead)
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())


def test_tokenizer_copies_are_made_before_the_engine_thread_runs(monkeypatch):
    """Each tokenizer thread gets a copy made in the constructor, never one deep-copied
    later from a thread while the output thread may be decoding with the original."""
    made = []
    monkeypatch.setattr(async_llm, "LLMEngine", FakeEngine)
    monkeypatch.setattr(FakeEngine, "tokenizer_copy",
                        lambda self: made.append(threading.current_thread().name) or (object(), object()))
    llm = AsyncLLM(EngineArgs(), log_stats=False)
    try:
        assert made == [threading.current_thread().name] * async_llm.TOKENIZER_THREADS

        async def use_all():
            return await asyncio.gather(*[llm._in_tokenizer_thread(llm._thread_tokenizer) for _ in range(32)])

        got = asyncio.run(use_all())
        assert len(made) == async_llm.TOKENIZER_THREADS           # nothing copied after start
        assert len({id(t) for t in got}) <= async_llm.TOKENIZER_THREADS
    finally:
        llm.shutdown()
