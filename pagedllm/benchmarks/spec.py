"""``pagedllm bench spec``: speculative decoding against plain decoding (``none``), in the
same run: per workload (``copy``, ``random``), concurrency and method, output tokens/s,
mean TPOT, draft acceptance rate, mean accepted length, speedup over ``none`` and whether
outputs equal the baseline's. Workloads and run order: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pagedllm.entrypoints.cli import HelpFormatter

from .report import output_file, save_json
from .serve_options import positive_int

_CODE = [
    '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())''',
    '''def parse_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings''',
]

_PASSAGES = [
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers "
    "climbed the one hundred and twelve steps every evening to light the lamp. In storms the spray "
    "reached the gallery, and the glass had to be wiped by hand so that ships could still see the "
    "beam. The last keeper left in 1987, when the light was made automatic.",
    "Bees communicate the direction of food through a waggle dance. The angle of the dance relative "
    "to vertical tells other bees the angle of the food source relative to the sun, and the length "
    "of the waggle run tells them how far away it is. A colony can shift its foraging within hours "
    "when a richer source is found.",
]

_QUESTIONS = [
    "Write a short story about a fox who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for learning a new language?",
    "Describe a perfect autumn day in a small village.",
    "Give some tips for cooking rice on a stove.",
    "Why do cats like to sit in boxes?",
    "Write a poem about the ocean at night.",
    "What should I pack for a weekend hiking trip?",
]


def copy_conversations() -> list[list[dict]]:
    """Copy-heavy chat requests (workloads: docs/notes/benchmarks.md)."""
    convs = []
    for code, (a, b) in zip(_CODE, [("values", "data"), ("count", "qty"), ("settings", "options")]):
        convs.append([{"role": "user", "content": f"Here is some Python code:\n```python\n{code}\n```\n"
                       f"Rewrite all of it with `{a}` renamed to `{b}`. Output only the full code."}])
    for p in _PASSAGES:
        convs.append([{"role": "user", "content": f"{p}\n\nQuote the text above word for word, then "
                                                  "summarise it in one sentence."}])
    calls = [{"name": "search_flights", "arguments": {"origin": "AMS", "destination": d, "date": "2026-12-0" + str(i),
                                                      "passengers": 2, "cabin": "economy"}}
             for i, d in enumerate(["LIS", "OPO", "MAD"], 1)]
    for i in range(3):
        trace = [{"role": "system", "content": "You are a travel agent. Answer only with a JSON tool call."}]
        for c in calls[: i + 1]:
            trace.append({"role": "user", "content": f"Find flights to {c['arguments']['destination']}."})
            trace.append({"role": "assistant", "content": json.dumps(c)})
        trace.append({"role": "user", "content": "Same search again, but for 3 passengers."})
        convs.append(trace)
    return convs


def random_conversations() -> list[list[dict]]:
    """Open-ended chat requests."""
    return [[{"role": "user", "content": q}] for q in _QUESTIONS]


WORKLOADS = {"copy": copy_conversations, "random": random_conversations}


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser("spec", help="speculative decoding vs plain decoding: tok/s, TPOT, acceptance",
                              formatter_class=HelpFormatter)
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "suffix"],
                   choices=["none", "ngram", "suffix", "draft_model"],
                   help="none = the baseline (always run first); draft_model needs --draft-model")
    p.add_argument("--draft-model", default=None, help="the draft model's path for draft_model")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=10,
                   help="k; copy-heavy text accepts long runs, and the adaptive draft length drops what does not pay")
    p.add_argument("--workloads", nargs="+", default=["copy", "random"], choices=list(WORKLOADS))
    p.add_argument("--concurrency", nargs="+", type=positive_int, default=[1, 8])
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--output-json", default=None, type=output_file)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=spec_main)


def spec_config(method: str, k: int, draft_model: str | None) -> str | None:
    """The ``--speculative-config`` JSON of a method name (None for ``none``)."""
    if method == "none":
        return None
    if method == "ngram":
        return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                           "prompt_lookup_max": 5})
    if method == "suffix":
        return json.dumps({"method": "suffix", "num_speculative_tokens": k})
    if not draft_model:
        raise ValueError("--methods draft_model needs --draft-model PATH")
    value = json.dumps({"method": "draft_model", "model": draft_model, "num_speculative_tokens": k})
    from pagedllm.config import SpeculativeConfig

    SpeculativeConfig.parse(value)    # a missing path fails here, before any model loads
    return value


def run_workload(llm, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """Run greedy requests with at most ``concurrency`` in flight; returns figures and the
    outputs (token ids, in prompt order)."""
    from pagedllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=output_len)
    s0 = eng.engine_core.get_scheduler_stats()
    pending = list(range(len(prompts)))
    outs: dict[int, object] = {}
    in_flight = 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i = pending.pop(0)
            eng.add_request(f"spec-bench-{i}", {"prompt_token_ids": prompts[i]}, sp)
            in_flight += 1
        for o in eng.step():
            if o.finished:
                outs[int(o.request_id.rsplit("-", 1)[1])] = o
                in_flight -= 1
    wall = time.perf_counter() - t0
    s1 = eng.engine_core.get_scheduler_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs.values())
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs.values() if len(o.outputs[0].token_ids) > 1]
    drafts = s1.spec_decode_num_drafts - s0.spec_decode_num_drafts
    dt = s1.spec_decode_num_draft_tokens - s0.spec_decode_num_draft_tokens
    acc = s1.spec_decode_num_accepted_tokens - s0.spec_decode_num_accepted_tokens
    return {"output_tokens": n_out, "wall_s": round(wall, 3), "output_tokens_per_s": round(n_out / wall, 2),
            "mean_tpot_ms": round(1e3 * sum(tpots) / len(tpots), 2) if tpots else None,
            "num_drafts": drafts, "num_draft_tokens": dt, "num_accepted_tokens": acc,
            "acceptance_rate": round(acc / dt, 3) if dt else None,
            "mean_accepted_length": round(1 + acc / drafts, 2) if drafts else None,
            "_outputs": [outs[i].outputs[0].token_ids for i in range(len(prompts))]}


def spec_main(args) -> int:
    """Entry point of ``pagedllm bench spec``; returns 0."""
    import torch

    from pagedllm import LLM
    from pagedllm.benchmarks.machine import machine_info
    from pagedllm.config import EngineArgs

    if getattr(args, "speculative_config", None):
        raise ValueError("bench spec builds --speculative-config per method: use --methods, "
                         "--num-speculative-tokens and --draft-model instead")
    methods = ["none"] + [m for m in args.methods if m != "none"]
    for m in methods:
        spec_config(m, args.num_speculative_tokens, args.draft_model)   # fail before loading anything
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    ea = EngineArgs.from_cli_args(args)
    base = {k: v for k, v in vars(ea).items() if k not in ("model", "speculative_config", "max_num_seqs")}
    base["max_num_seqs"] = max(max(args.concurrency), 1)
    results, prompts, dtype = [], None, None
    baseline: dict[tuple, dict] = {}
    # methods innermost: each one runs right after its baseline, on the same machine state
    for w in args.workloads:
        for c in args.concurrency:
            for m in methods:
                # a fresh engine per run: the suffix proposer's cache of earlier responses
                # must not hold this run's answers from a previous run
                llm = LLM(model=ea.model, speculative_config=spec_config(m, args.num_speculative_tokens,
                                                                         args.draft_model), **base)
                try:
                    dtype = str(llm.llm_engine.config.dtype).removeprefix("torch.")
                    if prompts is None:
                        prompts = {x: [llm.llm_engine.apply_chat_template(conv) for conv in WORKLOADS[x]()]
                                   for x in args.workloads}
                    warm = llm.llm_engine.apply_chat_template([{"role": "user", "content": "Hello!"}])
                    run_workload(llm, [warm], 8, 1)
                    r = run_workload(llm, prompts[w], args.output_len, c)
                finally:
                    llm.shutdown()
                outputs = r.pop("_outputs")
                r = {"workload": w, "concurrency": c, "method": m, **r}
                if m == "none":
                    baseline[(w, c)] = {**r, "_outputs": outputs}
                else:
                    b = baseline[(w, c)]
                    r["speedup_tokens_per_s"] = round(r["output_tokens_per_s"] / b["output_tokens_per_s"], 2)
                    r["same_output_as_none"] = outputs == b["_outputs"]
                results.append(r)
                print(_line(r), flush=True)
    machine = machine_info()
    print(f"\n{machine['cpu']} ({' '.join(machine['isa'])}); dtype {dtype}; torch threads "
          f"{torch.get_num_threads()}; k={args.num_speculative_tokens}; output {args.output_len} tokens, greedy")
    for r in results:
        print(_line(r))
    if args.output_json:
        save_json({"machine": machine, "dtype": dtype, "num_speculative_tokens": args.num_speculative_tokens,
                   "output_len": args.output_len, "results": results}, args.output_json)
    return 0


def _line(r: dict) -> str:
    s = (f"{r['workload']:>6} c={r['concurrency']:<2} {r['method']:>11}: {r['output_tokens_per_s']:7.1f} tok/s, "
         f"TPOT {r['mean_tpot_ms']} ms")
    if r["method"] != "none":
        s += (f", acceptance {r['acceptance_rate']}, mean accepted length {r['mean_accepted_length']}, "
              f"{r['speedup_tokens_per_s']:.2f}x, same output: {r['same_output_as_none']}")
    return s
