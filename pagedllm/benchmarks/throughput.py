"""``pagedllm bench throughput``: offline batch throughput on random-token prompts beside
HF transformers' batched ``generate``: req/s, output and total tokens/s over generation
time (loading excluded), and the workload's FLOPs (``workload_flops``) per second as a
fraction of ``torch.mm``'s rate in the run's dtype, with the CPU and its ISA flags."""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from pagedllm.entrypoints.cli import HelpFormatter

from .report import output_file, save_json
from .serve_options import positive_int


def register(subparsers: "argparse._SubParsersAction") -> None:
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser("throughput", help="offline throughput (random prompts, ignore_eos)",
                              formatter_class=HelpFormatter)
    p.add_argument("--backend", choices=["pagedllm", "hf", "both"], default="pagedllm",
                   help="hf: HF transformers batched generate; both: HF then pagedllm in one run")
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--input-len", type=positive_int, default=200)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF generate batch (default: all prompts)")
    p.add_argument("--no-mm", action="store_true",
                   help="skip the torch.mm reference measurement (in the run's dtype)")
    p.add_argument("--compare-args", default=None, metavar="FLAGS",
                   help="also time a second pagedllm engine: the same flags with these over them "
                        "(e.g. '--quantization int8'); both load at once, in this process, and take "
                        "turns of --interleave-steps steps on the same prompts, so that a machine "
                        "whose speed drifts treats them alike; prints each one's output tokens/s over "
                        "its own step time, and their ratio per round (--num-threads and --engine-process "
                        "are the process's and cannot differ; --profile-dir is refused)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds of the paired run (--compare-args)")
    p.add_argument("--interleave-steps", type=positive_int, default=4,
                   help="engine steps a turn in the paired run (--compare-args)")
    p.add_argument("--output-json", default=None, type=output_file)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=throughput_main)


def check_flags_reach_an_engine(args, backends: list[str]) -> None:
    """Refuse pagedllm-only engine flags (every engine setting but model, dtype, device,
    threads and seed) set off their defaults when no pagedllm engine runs, so that e.g.
    ``--backend hf -q int8`` cannot report HF's unquantized figure.

    Raises:
        ValueError: naming the first such flag and the backends.
    """
    import dataclasses

    from pagedllm.config import EngineArgs

    if "pagedllm" in backends:
        return
    shared = {"model", "dtype", "device", "num_threads", "seed"}
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name, f.default)
        if f.name not in shared and value != f.default:
            flag = f"--{f.name.replace('_', '-')}"
            raise ValueError(f"{flag} {value} applies to pagedllm, which --backend {' '.join(backends)} does not "
                             "run; run pagedllm too to measure it")


def random_prompts(n: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``input_len`` token ids drawn uniformly from [100, vocab_size)
    (skipping the low ids, where special tokens usually sit)."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size, size=(n, input_len)).tolist()


def workload_flops(arch, num_prompts: int, input_len: int, output_len: int) -> float:
    """Forward FLOPs (multiply-add = 2) of prefilling every prompt and decoding ``output_len``
    tokens each: linear layers 2·params per token, attention 4·heads·head_dim per (query, key)
    pair over the causal context, LM head 2·hidden·vocab per sampled token."""
    a = arch
    per_tok = 2 * a.num_hidden_layers * (
        a.hidden_size * (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
        + a.num_attention_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size)
    tokens = num_prompts * (input_len + output_len - 1)
    # causal pairs: prompt L(L+1)/2, then each decode step attends its full context
    pairs = num_prompts * (input_len * (input_len + 1) / 2
                           + sum(input_len + i + 1 for i in range(output_len - 1)))
    attn = 4 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * pairs
    head = 2 * a.hidden_size * a.vocab_size * num_prompts * output_len
    return per_tok * tokens + attn + head


def measure_mm_gflops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32,
                      budget_s: float = 3.0) -> float:
    """Best-of-``repeats`` ``torch.mm`` rate (GFLOP/s) for n×n matrices in ``dtype`` on the
    CPU; the size doubles from 256 up to ``n`` while the next product fits a tenth of
    ``budget_s``, so a dtype slow on this CPU keeps the reference small."""
    size = min(256, n)
    while True:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        t = time.perf_counter()
        torch.mm(a, b)
        first = time.perf_counter() - t
        if size * 2 > n or 8 * first > budget_s / 10:
            break
        size *= 2
    best, spent = 2 * size**3 / first / 1e9, first
    for _ in range(repeats):
        if spent > budget_s:
            break
        t = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t
        spent += dt
        best = max(best, 2 * size**3 / dt / 1e9)
    return best


def run_pagedllm(args, prompts) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineArgs

    ea = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(ea).items() if k != "model"}
    llm = LLM(model=ea.model, **kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()    # the warm-up's prompts must not be cache hits in the timed run
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    arch = llm.llm_engine.config.arch
    llm.shutdown()
    return {"backend": "pagedllm", "elapsed_s": elapsed, "output_tokens": n_out, "arch": arch,
            "dtype": str(llm.llm_engine.config.dtype), "torch_dtype": llm.llm_engine.config.dtype}


def _engine_label(ns) -> str:
    q = f"-q {ns.quantization}" if ns.quantization else "no quantization"
    return f"dtype {ns.dtype}, {q}, kv {ns.kv_cache_dtype}"


def paired_main(args, prompts) -> int:
    """``bench throughput --compare-args``: the command's engine and that plus
    ``--compare-args``, timed in turns (``paired.py``); the report is printed (and saved)
    before the engines shut down.

    Raises:
        ValueError: ``--backend`` other than pagedllm; ``--profile-dir``; a bad flag of either
            engine, or an engine that fails to load or take the prompts (named).
    """
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineArgs

    from .paired import compare_namespace, run_paired

    if args.backend != "pagedllm":
        raise ValueError("--compare-args compares two pagedllm engines: use --backend pagedllm")
    if args.profile_dir:
        raise ValueError("--profile-dir cannot be used with --compare-args: torch's profiler traces one "
                         "engine a process; profile each configuration in its own run")
    EngineArgs.from_cli_args(args).validate()   # the first engine's flags, before either loads
    namespaces = [args, compare_namespace(args, args.compare_args)]
    names = ["the command's engine (A)", f"--compare-args {args.compare_args!r} (B)"]
    llms = []
    try:
        for name, ns in zip(names, namespaces):
            ea = EngineArgs.from_cli_args(ns)
            kwargs = {k: v for k, v in vars(ea).items() if k not in ("model", "engine_process")}
            try:
                llm = LLM(model=ea.model, engine_process=False, **kwargs)
                llms.append(llm)
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             use_tqdm=False)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"{name}: {e}") from e
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        res = run_paired(llms, prompts, sp, args.rounds, args.interleave_steps, names)
        dtypes = [str(llm.llm_engine.config.dtype).removeprefix("torch.") for llm in llms]
        _paired_report(args, namespaces, dtypes, res)
    finally:
        for llm in llms:
            llm.shutdown()
    return 0


def _paired_report(args, namespaces, dtypes, res) -> None:
    from pagedllm.benchmarks.machine import machine_info

    machine = machine_info()
    labels = [f"A: {_engine_label(namespaces[0])} ({dtypes[0]})",
              f"B: {_engine_label(namespaces[1])} ({dtypes[1]}; --compare-args {args.compare_args!r})"]
    print(f"\n{machine['cpu']} ({' '.join(machine['isa'])}); workload: {args.num_prompts} prompts x "
          f"({args.input_len} in, {args.output_len} out); torch threads {torch.get_num_threads()}; "
          f"engines in turns of {args.interleave_steps} steps, {args.rounds} rounds")
    for lab in labels:
        print("  " + lab)
    rounds = []
    ratios = res.ratios()
    for i, ((ta, tb), ratio) in enumerate(zip(res.rounds, ratios)):
        rounds.append({"a_output_tokens": ta.output_tokens, "a_step_s": round(ta.seconds, 4), "a_steps": ta.steps,
                       "a_output_tokens_per_s": round(ta.output_tokens_per_s, 1),
                       "b_output_tokens": tb.output_tokens, "b_step_s": round(tb.seconds, 4), "b_steps": tb.steps,
                       "b_output_tokens_per_s": round(tb.output_tokens_per_s, 1), "ratio_b_over_a": round(ratio, 4)})
        print(f"round {i + 1}: A {ta.output_tokens_per_s:.1f} tok/s ({ta.output_tokens} tokens, {ta.seconds:.2f} s, "
              f"{ta.steps} steps) | B {tb.output_tokens_per_s:.1f} tok/s ({tb.output_tokens} tokens, "
              f"{tb.seconds:.2f} s, {tb.steps} steps) | B/A {ratio:.3f}x")
    ta, tb = res.total(0), res.total(1)
    overall = tb.output_tokens_per_s / ta.output_tokens_per_s
    print(f"all rounds: A {ta.output_tokens_per_s:.1f} | B {tb.output_tokens_per_s:.1f} output tok/s of step time; "
          f"B/A {overall:.3f}x (geometric mean of rounds "
          f"{res.geometric_mean_ratio():.3f}x, range {min(ratios):.3f}-{max(ratios):.3f}x)")
    if args.output_json:
        save_json({"machine": machine, "num_prompts": args.num_prompts, "input_len": args.input_len,
                   "output_len": args.output_len, "threads": torch.get_num_threads(),
                   "interleave_steps": args.interleave_steps, "engines": labels, "rounds": rounds,
                   "a_output_tokens_per_s": round(ta.output_tokens_per_s, 1),
                   "b_output_tokens_per_s": round(tb.output_tokens_per_s, 1),
                   "ratio_b_over_a": round(overall, 4),
                   "ratio_geometric_mean_of_rounds": round(res.geometric_mean_ratio(), 4)},
                  args.output_json)


def load_hf_model(args):
    """(model, dtype, device): the HF transformers model of ``args.model`` (GGUF or HF
    directory) in ``--dtype`` on ``--device``."""
    import os

    from transformers import AutoModelForCausalLM

    from pagedllm.config import resolve_dtype
    from pagedllm.models.loader import is_gguf, load_arch_config
    from pagedllm.utils import default_model_path, resolve_device

    path = args.model or default_model_path()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, load_arch_config(path))
    if is_gguf(path):
        # dequantized in float32, then cast: asked for bf16, transformers' GGUF loader prints
        # a note about packed weights that does not apply to a dequantized model
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval(), dtype, device


def run_hf(args, prompts) -> dict:
    from pagedllm.models.loader import load_arch_config
    from pagedllm.utils import default_model_path

    path = args.model or default_model_path()
    model, dtype, device = load_hf_model(args)
    bsz = args.hf_batch_size or len(prompts)
    n_out = 0
    kw = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
              pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:2], device=device), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        for i in range(0, len(prompts), bsz):
            batch = torch.tensor(prompts[i:i + bsz], device=device)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kw)
            n_out += (out.shape[1] - batch.shape[1]) * out.shape[0]
        elapsed = time.perf_counter() - t
    return {"backend": "hf", "elapsed_s": elapsed, "output_tokens": n_out,
            "arch": load_arch_config(path), "dtype": str(dtype), "torch_dtype": dtype}


def throughput_main(args) -> int:
    """Entry point of ``pagedllm bench throughput``; returns 0."""
    from pagedllm.models.loader import load_arch_config
    from pagedllm.utils import default_model_path

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    arch = load_arch_config(args.model or default_model_path())
    prompts = random_prompts(args.num_prompts, args.input_len, arch.vocab_size, args.seed)
    if args.compare_args is not None:
        return paired_main(args, prompts)
    results = []
    backends = ["hf", "pagedllm"] if args.backend == "both" else [args.backend]
    check_flags_reach_an_engine(args, backends)
    for b in backends:
        results.append(run_hf(args, prompts) if b == "hf" else run_pagedllm(args, prompts))
    from pagedllm.benchmarks.machine import machine_info

    mm_dtype = results[-1]["torch_dtype"]
    mm = None if args.no_mm else measure_mm_gflops(dtype=mm_dtype)
    mm_name = str(mm_dtype).removeprefix("torch.")
    flops = workload_flops(arch, args.num_prompts, args.input_len, args.output_len)
    machine = machine_info()
    report = {"machine": machine, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "torch_mm_gflops": mm, "torch_mm_dtype": mm_name,
              "workload_gflop": flops / 1e9, "threads": torch.get_num_threads(), "results": []}
    print(f"\n{machine['cpu']} ({' '.join(machine['isa'])}); workload: {args.num_prompts} prompts x "
          f"({args.input_len} in, {args.output_len} out), {flops / 1e12:.2f} TFLOP; "
          f"torch threads {torch.get_num_threads()}")
    if mm:
        print(f"torch.mm {mm_name}: {mm:.1f} GFLOP/s")
    for r in results:
        el = r["elapsed_s"]
        total = args.num_prompts * args.input_len + r["output_tokens"]
        gf = flops / el / 1e9
        row = {"backend": r["backend"], "dtype": r["dtype"], "elapsed_s": round(el, 2),
               "requests_per_s": round(args.num_prompts / el, 3),
               "output_tokens_per_s": round(r["output_tokens"] / el, 1),
               "total_tokens_per_s": round(total / el, 1), "achieved_gflops": round(gf, 1),
               "fraction_of_mm": round(gf / mm, 3) if mm else None}
        report["results"].append(row)
        print(f"[{row['backend']:>8}] {row['elapsed_s']:.1f} s | {row['requests_per_s']:.2f} req/s | "
              f"output {row['output_tokens_per_s']:.1f} tok/s | total {row['total_tokens_per_s']:.1f} tok/s | "
              f"{gf:.1f} GFLOP/s" + (f" ({100 * gf / mm:.0f}% of torch.mm)" if mm else ""))
    if len(results) == 2:
        ratio = report["results"][1]["output_tokens_per_s"] / report["results"][0]["output_tokens_per_s"]
        report["speedup_output_tokens"] = round(ratio, 2)
        print(f"pagedllm / hf output tokens/s: {ratio:.2f}x")
    if args.output_json:
        save_json(report, args.output_json)
    return 0
