"""Helpers shared by the engine tests (imported by name: a test module cannot import
``conftest`` reliably, since tests/ and tests/bench/ each have one)."""
from __future__ import annotations

REF_TOKENS = 16


def tiny_llama(vocab_size: int, **config):
    """The suite's tiny random-weight Llama (``model_helpers.build_tiny_model``: 2 layers,
    hidden 256, 4 q / 2 kv heads x 64, weights ~N(0, 0.1), seed 0) with ``vocab_size`` and
    ``config`` over it, not saved. To get a saved directory, use the ``tiny_model_dir``
    fixture (or ``tiny_dir``, the one most tests share)."""
    from model_helpers import build_tiny_model

    return build_tiny_model("llama", vocab_size=vocab_size, **config)


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
    if eng.parents:
        problems.append(f"front end still tracks the parallel-sampling requests {sorted(eng.parents)}")
    return problems


def random_prompts(n: int, seed: int, vocab: int = 49152, min_len: int = 4, max_len: int = 60) -> list[dict]:
    """``n`` prompts of random token ids in [3, vocab), each min_len..max_len - 1 long."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, size=int(rng.integers(min_len, max_len))).tolist()}
            for _ in range(n)]


def assert_greedy_invariant(make_llm, prompts, params, settings: dict[str, dict]) -> list[list[int]]:
    """Each prompt's greedy tokens with the engine built as ``make_llm(**settings[name])``
    (prefix caching off unless a setting turns it on) equal those of the prompt run alone;
    a setting named "cached" runs twice and must hit the cache, one named "preempted"
    must preempt; every engine ends idle with every block free. Returns the alone tokens.

    ``make_llm(**kw)``: a new in-process LLM with the test's model and ``kw`` over its defaults.
    """
    base = make_llm(enable_prefix_caching=False)
    try:
        alone = run_alone(base, prompts, params)
    finally:
        base.shutdown()
    for name, kw in settings.items():
        llm = make_llm(**{"enable_prefix_caching": False, **kw})
        try:
            core = engine_core(llm.llm_engine)
            for _ in range(2 if name == "cached" else 1):   # the second run hits the cache
                outs = llm.generate(prompts, params, use_tqdm=False)
                assert [list(o.outputs[0].token_ids) for o in outs] == alone, name
            if name == "cached":
                assert core.kv.stats.hits > 0
            if name == "preempted":
                assert core.scheduler.num_preemptions_total > 0
            assert engine_leaks(llm) == [], name
        finally:
            llm.shutdown()
    return alone
