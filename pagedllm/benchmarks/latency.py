"""``pagedllm bench latency``: single-stream (or small-batch) latency as ``vllm bench
latency``: TTFT, decode tokens/s and time per decode step split into the model's matmuls
(``matmul_seconds_per_step``) and the rest, beside HF ``generate`` (and llama.cpp) on the
same prompt in the same run. "Rest" = measured step minus matmul time, so it can come out
negative on a busy machine. Method: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import time

import torch
from pagedllm.entrypoints.cli import HelpFormatter

from .report import output_file, save_json
from .serve_options import positive_int


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser("latency", help="single-stream latency: TTFT, decode tok/s, matmul vs rest",
                              formatter_class=HelpFormatter)
    p.add_argument("--backend", nargs="+", choices=["pagedllm", "hf", "llama.cpp", "both"], default=["pagedllm"],
                   help="one or more, run in this order and compared with the last: hf: HF transformers "
                        "generate; llama.cpp: llama-cpp-python on the same GGUF file (if installed; "
                        "batch 1); both: hf then pagedllm")
    p.add_argument("--batch-size", type=positive_int, default=1, help="requests decoded together")
    p.add_argument("--input-len", type=positive_int, default=200)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--num-iters", type=positive_int, default=3, help="timed runs a round (the best is reported)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="rounds taking the backends in turn, all loaded at once (a machine whose speed "
                        "drifts then treats them alike; the ratio of each round is printed)")
    p.add_argument("--busy-neighbours", type=positive_int, default=None, metavar="N",
                   help="also time each backend beside N busy-loop processes (a busy neighbour on shared "
                        "cores): median decode tok/s quiet and beside them, and their ratio")
    p.add_argument("--output-json", default=None, type=output_file)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=latency_main)


def start_busy_neighbours(n: int, seconds: float = 900.0) -> list:
    """``n`` Python processes that spin for at most ``seconds``, and stop as soon as this
    process is gone (however it ended); they ignore Ctrl-C (this process stops them)."""
    import os
    import subprocess
    import sys

    code = (f"import os, signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            f"end = time.monotonic() + {seconds}\n"
            f"while time.monotonic() < end and os.getppid() == {os.getpid()}: pass")
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def neighbour_runs(runner, n: int, num_iters: int) -> dict:
    """Median decode tok/s of ``num_iters`` runs of the generator ``runner`` quiet, then
    beside ``n`` busy processes; closes the generator and stops the processes."""
    import statistics

    try:
        quiet = [next(runner) for _ in range(num_iters)]
        procs = start_busy_neighbours(n)
        try:
            time.sleep(0.5)
            busy = [next(runner) for _ in range(num_iters)]
        finally:
            for p in procs:
                p.kill()
                p.wait()
    finally:
        runner.close()
    q = statistics.median(r["decode_tokens_per_s"] for r in quiet)
    b = statistics.median(r["decode_tokens_per_s"] for r in busy)
    return {"backend": quiet[0]["backend"], "busy_neighbours": n, "quiet_decode_tokens_per_s": q,
            "busy_decode_tokens_per_s": b, "busy_over_quiet": round(b / q, 3),
            "quiet_runs": [r["decode_tokens_per_s"] for r in quiet],
            "busy_runs": [r["decode_tokens_per_s"] for r in busy]}


def matmul_seconds_per_step(arch, dtype: torch.dtype, device: torch.device, rows: int,
                            repeats: int = 5) -> float:
    """Best-of-``repeats`` seconds for one pass of ``rows`` rows through every linear layer
    of a model shaped as ``arch`` (random weights, the engine's linear method for
    ``dtype`` on ``device``), in model order, LM head last."""
    from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear

    a = arch
    g = torch.Generator(device="cpu").manual_seed(0)
    layers = []

    def init(layer):
        w = layer.weight
        w.data.copy_(torch.randn(w.shape, generator=g).mul_(0.02).to(dtype))
        layer.linear_method.process_weights_after_loading(layer)
        return layer

    for _ in range(a.num_hidden_layers):
        layers.append(init(QKVParallelLinear(a.hidden_size, a.head_dim, a.num_attention_heads,
                                             a.num_key_value_heads, False, dtype, device)))
        layers.append(init(ReplicatedLinear(a.num_attention_heads * a.head_dim, a.hidden_size, False,
                                            dtype, device)))
        layers.append(init(MergedColumnParallelLinear(a.hidden_size, [a.intermediate_size] * 2, False,
                                                      dtype, device)))
        layers.append(init(ReplicatedLinear(a.intermediate_size, a.hidden_size, False, dtype, device)))
    layers.append(init(ReplicatedLinear(a.hidden_size, a.vocab_size, False, dtype, device)))
    inputs = {n: torch.randn(rows, n, generator=g).to(dtype).to(device)
              for n in {m.input_size for m in layers}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):            # the first pass warms up
            t = time.perf_counter()
            for m in layers:
                m(inputs[m.input_size])
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    return best


def _summary(prefill_s: float, decode_s: float, batch: int, output_len: int) -> dict:
    steps = max(output_len - 1, 1)
    return {"ttft_s": round(prefill_s, 4), "decode_s": round(decode_s, 3),
            "decode_ms_per_step": round(1e3 * decode_s / steps, 2),
            "decode_tokens_per_s": round(batch * steps / decode_s, 1)}


def run_pagedllm(args, prompts):
    """A generator: loads and warms up the engine, then yields one timed run per ``next``
    (TTFT and decode time from the requests' metrics); shuts the engine down when closed."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineArgs

    ea = EngineArgs.from_cli_args(args)
    llm = LLM(model=ea.model, **{k: v for k, v in vars(ea).items() if k != "model"})
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(inputs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        cfg = llm.llm_engine.config
        while True:
            llm.reset_prefix_cache()
            outs = llm.generate(inputs, sp, use_tqdm=False)
            ttft = max(o.metrics.ttft for o in outs)
            first = max(o.metrics.first_token_time for o in outs)
            decode = max(o.metrics.finished_time for o in outs) - first
            kv = str(cfg.kv_cache_dtype).removeprefix("torch.")
            yield {"backend": "pagedllm", "dtype": str(cfg.dtype).removeprefix("torch."), "kv_cache_dtype": kv,
                   **_summary(ttft, decode, len(prompts), args.output_len),
                   "_arch": cfg.arch, "_dtype": cfg.dtype, "_device": cfg.device}
    finally:
        llm.shutdown()


def run_hf(args, prompts):
    """A generator yielding one timed run per ``next``: prefill = ``generate`` of one
    token; decode = a full ``generate`` minus that."""
    from .throughput import load_hf_model

    model, dtype, device = load_hf_model(args)
    batch = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(batch))
    with torch.inference_mode():
        model.generate(batch, max_new_tokens=4, min_new_tokens=4, **kw)
    while True:
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(batch, max_new_tokens=1, min_new_tokens=1, **kw)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(batch, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **kw)
            full = time.perf_counter() - t
        yield {"backend": "hf", "dtype": str(dtype).removeprefix("torch."),
               **_summary(prefill, max(full - prefill, 1e-9), len(prompts), args.output_len)}


def run_llama_cpp(args, prompts):
    """A generator of timed llama.cpp runs (``llama-cpp-python``) on the same GGUF and thread
    count: prefill = ``eval`` of the prompt, decode = ``output_len - 1`` greedy steps.

    Raises:
        ValueError: llama-cpp-python missing, a model that is not .gguf, or batch > 1.
    """
    from pagedllm.models.loader import is_gguf
    from pagedllm.utils import default_model_path

    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError("--backend llama.cpp needs llama-cpp-python (pip install llama-cpp-python)") from e
    path = args.model or default_model_path()
    if not is_gguf(path):
        raise ValueError(f"--backend llama.cpp needs a .gguf --model, got {path!r}")
    if len(prompts) != 1:
        raise ValueError("--backend llama.cpp runs one sequence: use --batch-size 1")
    threads = args.num_threads or torch.get_num_threads()
    llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads,
                          n_ctx=args.input_len + args.output_len + 8, verbose=False)

    def timed():
        warm = True                          # the first run is a warm-up
        while True:
            llm.reset()
            t = time.perf_counter()
            llm.eval(prompts[0])
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(args.output_len - 1):
                llm.eval([llm.sample(temp=0.0)])
            r = _summary(prefill, time.perf_counter() - t, 1, args.output_len)
            if not warm:
                yield {"backend": "llama.cpp", "dtype": f"gguf ({llama_cpp.__version__}, {threads} threads)", **r}
            warm = False

    return timed()


def best_runs(runners, rounds: int, num_iters: int) -> tuple[list[dict], list[list[float]]]:
    """Run every generator of ``runners`` (all loaded) ``rounds`` times in turn, ``num_iters``
    runs a turn; returns each backend's best run (least decode time) and per round each one's
    best decode tokens/s; closes the generators."""
    best: list[dict | None] = [None] * len(runners)
    per_round = []
    try:
        for _ in range(rounds):
            row = []
            for i, g in enumerate(runners):
                rb = min((next(g) for _ in range(num_iters)), key=lambda r: r["decode_s"])
                row.append(rb["decode_tokens_per_s"])
                if best[i] is None or rb["decode_s"] < best[i]["decode_s"]:
                    best[i] = rb
            per_round.append(row)
    finally:
        for g in runners:
            g.close()
    return best, per_round


def latency_main(args) -> int:
    """Entry point of ``pagedllm bench latency``; returns 0."""
    from pagedllm.benchmarks.machine import machine_info
    from pagedllm.models.loader import load_arch_config
    from pagedllm.utils import default_model_path

    from .throughput import check_flags_reach_an_engine, random_prompts

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    arch = load_arch_config(args.model or default_model_path())
    prompts = random_prompts(args.batch_size, args.input_len, arch.vocab_size, args.seed)
    backends = [x for b in args.backend for x in (["hf", "pagedllm"] if b == "both" else [b])]
    check_flags_reach_an_engine(args, backends)
    runners = {"hf": run_hf, "llama.cpp": run_llama_cpp, "pagedllm": run_pagedllm}
    if args.busy_neighbours:
        if args.rounds > 1:
            raise SystemExit("bench latency: --busy-neighbours takes no --rounds (each backend runs quiet, "
                             "then beside the busy processes)")
        return _neighbours_main(args, prompts, backends, runners)
    if args.rounds == 1:              # one backend loaded at a time
        results = [best_runs([runners[b](args, prompts)], 1, args.num_iters)[0][0] for b in backends]
        per_round = [[r["decode_tokens_per_s"] for r in results]]
    else:
        # pagedllm's and HF's generators load their model on the first next(), inside
        # best_runs (which closes them all); llama.cpp's loads here and is freed with it
        results, per_round = best_runs([runners[b](args, prompts) for b in backends], args.rounds,
                                       args.num_iters)
    machine = machine_info()
    print(f"\n{machine['cpu']} ({' '.join(machine['isa'])}); torch threads {torch.get_num_threads()}; "
          f"batch {args.batch_size} x ({args.input_len} in, {args.output_len} out)")
    for r in results:
        extra = ""
        if r["backend"] == "pagedllm" and args.quantization:
            # the split times random dense-shaped layers; quantized layers' weights come from
            # the checkpoint (packed blocks), so it is not measured rather than misreported
            for k in ("_arch", "_dtype", "_device"):
                r.pop(k)
            r["dtype"] += f", --quantization {args.quantization}"
            extra = " (matmul split not measured with --quantization)"
        elif r["backend"] == "pagedllm":
            mm = matmul_seconds_per_step(r.pop("_arch"), r.pop("_dtype"), r.pop("_device"), args.batch_size)
            r["matmul_ms_per_step"] = round(1e3 * mm, 2)
            r["other_ms_per_step"] = round(r["decode_ms_per_step"] - 1e3 * mm, 2)
            extra = f" = matmuls {r['matmul_ms_per_step']:.1f} + rest {r['other_ms_per_step']:.1f} ms"
            if r["other_ms_per_step"] < 0:
                # measured apart from the steps: on a busy machine the two can disagree
                extra += " (the matmul pass ran slower than the steps did: the machine is busy, rerun)"
        label = r["dtype"] + (f", KV cache {r['kv_cache_dtype']}" if "kv_cache_dtype" in r else "")
        print(f"[{r['backend']:>8}] {label} | TTFT {r['ttft_s'] * 1e3:.0f} ms | decode "
              f"{r['decode_tokens_per_s']:.1f} tok/s | {r['decode_ms_per_step']:.1f} ms/step{extra}")
    report = {"machine": machine, "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "rounds": args.rounds, "results": results,
              "decode_tokens_per_s_by_round": per_round}
    last = results[-1]
    for i, r in enumerate(results[:-1]):
        ratio = last["decode_tokens_per_s"] / r["decode_tokens_per_s"]
        report[f"speedup_decode_tokens_vs_{r['backend']}"] = round(ratio, 2)
        line = f"{last['backend']} / {r['backend']} decode tokens/s: {ratio:.2f}x"
        if args.rounds > 1:
            line += " (by round: " + ", ".join(f"{row[-1] / row[i]:.2f}x" for row in per_round) + ")"
        print(line)
    if args.output_json:
        save_json(report, args.output_json)
    return 0


def _neighbours_main(args, prompts, backends, runners) -> int:
    """``--busy-neighbours``: each backend quiet and beside the busy processes."""
    from pagedllm.benchmarks.machine import machine_info

    machine = machine_info()
    print(f"\n{machine['cpu']} ({' '.join(machine['isa'])}); torch threads {torch.get_num_threads()}; "
          f"batch {args.batch_size} x ({args.input_len} in, {args.output_len} out); "
          f"{args.busy_neighbours} busy process(es) beside it")
    results = []
    for b in backends:
        r = neighbour_runs(runners[b](args, prompts), args.busy_neighbours, args.num_iters)
        results.append(r)
        print(f"[{b:>8}] decode {r['quiet_decode_tokens_per_s']:.1f} tok/s quiet, "
              f"{r['busy_decode_tokens_per_s']:.1f} beside {args.busy_neighbours} busy: "
              f"{r['busy_over_quiet']:.2f}x (medians of {args.num_iters})")
    if args.output_json:
        save_json({"machine": machine, "batch_size": args.batch_size, "input_len": args.input_len,
                   "output_len": args.output_len, "results": results}, args.output_json)
    return 0
