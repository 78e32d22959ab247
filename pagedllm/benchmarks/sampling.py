"""``pagedllm bench sampling``: what the sampling options and structured outputs cost
against greedy decoding, in the same run. The same N concurrent chat requests run in each
mode (``greedy``; ``sampling``: every sampling option at once; ``json``: greedy under a
JSON schema), modes interleaved over ``--repeats`` rounds, ``--output-len`` tokens each.
Reported per mode: median output tokens/s, its ratio to greedy's, and the median
per-round ratio. Details: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

from .report import output_file, save_json
from .serve_options import positive_int

MODES = ("greedy", "sampling", "json")

_TOPICS = ["the ocean", "volcanoes", "the Roman empire", "bees", "the moon", "chess", "bread", "rivers",
           "music theory", "trains", "glaciers", "the printing press", "owls", "coffee", "deserts",
           "electricity", "the Silk Road", "rainforests", "clocks", "whales", "mountains", "paper",
           "the immune system", "bridges", "tea", "comets", "wolves", "the alphabet", "salt", "castles",
           "lighthouses", "honey"]

SCHEMA = {"type": "object",
          "properties": {"topic": {"type": "string"},
                         "facts": {"type": "array", "items": {"type": "string"}, "minItems": 10, "maxItems": 10}},
          "required": ["topic", "facts"], "additionalProperties": False}


def mode_params(mode: str, output_len: int, i: int):
    """The SamplingParams of request ``i`` in ``mode``."""
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    if mode == "greedy":
        return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    if mode == "sampling":
        return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.02, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={13: -2.0, 30: 1.0},
                              logprobs=5, seed=i, max_tokens=output_len, ignore_eos=True)
    if mode == "json":
        return SamplingParams(temperature=0, max_tokens=output_len,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def run_mode(llm, prompts: list[list[int]], mode: str, output_len: int) -> dict:
    """All prompts at once in ``mode``; returns output tokens, wall seconds and tokens/s."""
    params = [mode_params(mode, output_len, i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"output_tokens": n, "wall_s": round(wall, 3), "output_tokens_per_s": round(n / wall, 2)}


def sampling_main(args) -> int:
    """Entry point of ``pagedllm bench sampling``; returns 0."""
    import torch

    from pagedllm import LLM
    from pagedllm.benchmarks.machine import machine_info
    from pagedllm.config import EngineArgs

    for m in args.modes:
        mode_params(m, 1, 0)          # an unknown mode fails before the model loads
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    ea = EngineArgs.from_cli_args(args)
    kw = {k: v for k, v in vars(ea).items() if k != "model"}
    kw["max_num_seqs"] = max(kw.get("max_num_seqs") or 0, args.num_prompts)
    llm = LLM(model=ea.model, **kw)
    try:
        dtype = str(llm.llm_engine.config.dtype).removeprefix("torch.")
        prompts = [llm.llm_engine.apply_chat_template(
            [{"role": "user", "content": f"Tell me ten facts about {_TOPICS[i % len(_TOPICS)]}."}])
            for i in range(args.num_prompts)]
        for m in args.modes:                      # warm-up: kernels, the grammar compile
            run_mode(llm, prompts[:2], m, 4)
        runs: dict[str, list[dict]] = {m: [] for m in args.modes}
        for r in range(args.repeats):
            for m in args.modes:
                res = run_mode(llm, prompts, m, args.output_len)
                runs[m].append(res)
                print(f"round {r + 1} {m:>8}: {res['output_tokens_per_s']:7.1f} tok/s "
                      f"({res['output_tokens']} tokens in {res['wall_s']} s)", flush=True)
    finally:
        llm.shutdown()
    med = {m: statistics.median(x["output_tokens_per_s"] for x in runs[m]) for m in args.modes}
    machine = machine_info()
    print(f"\n{machine['cpu']} ({' '.join(machine['isa'])}); dtype {dtype}; torch threads "
          f"{torch.get_num_threads()}; {args.num_prompts} concurrent requests x {args.output_len} output tokens; "
          f"median of {args.repeats}")
    base = med.get("greedy")
    # each round's ratio to that round's greedy run (seconds apart), then their median:
    # steadier than a ratio of medians when the machine's speed drifts between rounds
    round_ratio = {m: statistics.median(x["output_tokens_per_s"] / g["output_tokens_per_s"]
                                        for x, g in zip(runs[m], runs["greedy"]))
                   for m in args.modes} if base else {}
    for m in args.modes:
        ratio = f", {med[m] / base:.2f}x greedy (per-round ratios: median {round_ratio[m]:.2f}x)" if base else ""
        print(f"{m:>8}: {med[m]:7.1f} tok/s{ratio}")
    if args.output_json:
        save_json({"machine": machine, "dtype": dtype, "num_prompts": args.num_prompts,
                   "output_len": args.output_len, "median_tokens_per_s": med,
                   "median_round_ratio_to_greedy": round_ratio, "runs": runs}, args.output_json)
    return 0


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser("sampling", help="sampling options and JSON-schema decoding against greedy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(p)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--num-prompts", type=positive_int, default=32, help="concurrent requests")
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds of all modes (median reported)")
    p.add_argument("--output-json", default=None, type=output_file)
    p.set_defaults(func=sampling_main)
