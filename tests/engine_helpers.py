"""Helpers shared by the engine tests (imported by name: a test module cannot import
``conftest`` reliably, since tests/ and tests/bench/ each have one)."""
from __future__ import annotations

REF_TOKENS = 16


def greedy(max_tokens: int = 32):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_alone(llm, prompts, params) -> list[list[int]]:
    """Generate for each prompt in its own ``generate`` call (batch of one)."""
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def engine_core(llm_engine):
    """The in-process EngineCore behind an LLMEngine (tests may look inside; the front
    end itself never does). Raises TypeError for an engine whose core runs in its own
    process: build it with ``engine_process=False``."""
    client = llm_engine.engine_core
    if not hasattr(client, "engine_core"):
        raise TypeError("this engine's core runs in its own process; build it with engine_process=False")
    return client.engine_core


def model_runner(llm_engine):
    """The in-process ModelRunner behind an LLMEngine (tests only)."""
    return engine_core(llm_engine).executor.driver_worker.model_runner


def engine_leaks(llm) -> list[str]:
    """Problems that show an engine is not back to idle (empty list when it is)."""
    eng = llm.llm_engine
    core = engine_core(eng)
    sched = core.scheduler
    problems = []
    if core.kv.num_free_blocks != core.kv.num_blocks:
        problems.append(f"{core.kv.num_blocks - core.kv.num_free_blocks} of {core.kv.num_blocks} "
                        f"KV blocks still held")
    if core.kv.req_blocks:
        problems.append(f"block tables left for {sorted(core.kv.req_blocks)}")
    if sched.running or sched.waiting:
        problems.append(f"{len(sched.running)} running / {len(sched.waiting)} waiting requests left")
    if sched.requests:
        problems.append(f"scheduler still tracks {sorted(sched.requests)}")
    if eng.states:
        problems.append(f"front end still tracks {sorted(eng.states)}")
    return problems
