"""Two pagedllm engines timed in turns on the same workload (``pagedllm bench throughput
--compare-args``): both loaded in this process (core in process), the same prompts,
``interleave_steps`` steps of one then of the other until both finish. Timed: each
engine's own ``LLMEngine.step`` calls, summed; throughput = output tokens / that sum.
Why: docs/notes/benchmarks.md."""
from __future__ import annotations

import argparse
import math
import shlex
import time
from dataclasses import dataclass, field


# Settings of the process, not of an engine: a second engine in the same process cannot
# have its own (why, for the error message).
_SHARED_SETTINGS = {
    "num_threads": "torch's thread count is the process's: the second engine would set it for both",
    "engine_process": "both engines run their cores in this process here",
    "profile_dir": "torch's profiler traces one engine a process",
}


def compare_namespace(args: argparse.Namespace, compare_args: str) -> argparse.Namespace:
    """``args`` with the engine flags of ``compare_args`` (shell-quoted, e.g.
    ``"--quantization int8"``) parsed over it: the second engine's settings.

    Raises:
        ValueError (naming ``--compare-args`` and the flag): empty or badly quoted; not an
            engine flag; a value its flag or ``EngineArgs.validate`` refuses; a process
            setting (``_SHARED_SETTINGS``) different from the first engine's.
    """
    from pagedllm.config import EngineArgs

    try:
        words = shlex.split(compare_args)
    except ValueError as e:        # shlex: "No closing quotation" and the like
        raise ValueError(f"--compare-args {compare_args!r}: {e}") from None
    if not words:
        raise ValueError("--compare-args is empty: give the second engine's flags, e.g. '--quantization int8'")

    class _Parser(argparse.ArgumentParser):
        def error(self, message):            # argparse exits; a bench flag error is a ValueError
            raise ValueError(f"--compare-args {compare_args!r}: {message}")

    p = _Parser(prog="--compare-args", add_help=False)
    EngineArgs.add_cli_args(p)
    ns = argparse.Namespace(**vars(args))
    extra = p.parse_known_args(words, namespace=ns)[1]
    if extra:
        raise ValueError(f"--compare-args {compare_args!r}: not engine flags: {' '.join(extra)}")
    for name in _SHARED_SETTINGS:
        if getattr(ns, name) != getattr(args, name):
            raise ValueError(f"--compare-args {compare_args!r}: --{name.replace('_', '-')} cannot differ between "
                             f"the two engines ({_SHARED_SETTINGS[name]})")
    try:   # checked now, not after the first engine has loaded
        EngineArgs.from_cli_args(ns).validate()
    except ValueError as e:
        raise ValueError(f"--compare-args {compare_args!r}: {EngineArgs.cli_message(e)}") from e
    return ns


@dataclass
class EngineTally:
    """One engine's share of a paired run: ``seconds`` of its own steps, ``steps`` taken,
    ``output_tokens`` of its finished requests."""
    seconds: float = 0.0
    steps: int = 0
    output_tokens: int = 0
    finished: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PairedResult:
    """Per round, each engine's tally (``rounds[i][j]``: round i, engine j)."""
    rounds: list[list[EngineTally]] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """Second engine's output tokens/s over the first's, per round."""
        return [r[1].output_tokens_per_s / r[0].output_tokens_per_s for r in self.rounds]

    def geometric_mean_ratio(self) -> float:
        rs = self.ratios()
        return math.exp(sum(math.log(r) for r in rs) / len(rs))

    def total(self, j: int) -> EngineTally:
        """Engine ``j``'s tallies summed over the rounds."""
        t = EngineTally()
        for r in self.rounds:
            t.seconds += r[j].seconds
            t.steps += r[j].steps
            t.output_tokens += r[j].output_tokens
            t.finished += r[j].finished
        return t


def _one_turn(engine, tally: EngineTally, steps: int) -> None:
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            return
        t = time.perf_counter()
        outs = engine.step()
        tally.seconds += time.perf_counter() - t
        tally.steps += 1
        for o in outs:
            if o.finished:
                tally.finished += 1
                tally.output_tokens += len(o.outputs[0].token_ids)


def run_paired(llms: list, prompts: list[list[int]], sampling_params, rounds: int,
               interleave_steps: int, names: list[str] | None = None) -> PairedResult:
    """Run ``prompts`` (token-id lists) on both warmed-up ``llms`` ``rounds`` times in turns
    of ``interleave_steps`` steps (the first engine starts odd rounds, the second even ones);
    both prefix caches are reset before each round.

    Raises:
        ValueError: not two engines, rounds or turn length below 1, or an engine refusing the
            prompts (the message starts with its entry of ``names``).
    """
    if len(llms) != 2:
        raise ValueError(f"run_paired compares two engines, got {len(llms)}")
    if rounds < 1 or interleave_steps < 1:
        raise ValueError("rounds and interleave_steps must be >= 1")
    names = names or ["engine A", "engine B"]
    engines = [llm.llm_engine for llm in llms]
    result = PairedResult()
    for r in range(rounds):
        tallies = [EngineTally(), EngineTally()]
        for name, llm, eng in zip(names, llms, engines):
            llm.reset_prefix_cache()
            try:
                for p in prompts:
                    eng.add_request(eng.next_request_id(), {"prompt_token_ids": p}, sampling_params)
            except ValueError as e:
                for e2 in engines:     # nothing left queued in either
                    e2.abort_request(e2.unfinished_request_ids())
                raise ValueError(f"{name}: {e}") from e
        order = [0, 1] if r % 2 == 0 else [1, 0]
        while any(e.has_unfinished_requests() for e in engines):
            for j in order:
                _one_turn(engines[j], tallies[j], interleave_steps)
        result.rounds.append(tallies)
    return result
