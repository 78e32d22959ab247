"""``pagedllm bench accuracy``: what a ``--dtype``, a ``--quantization`` or a
``--kv-cache-dtype`` costs in accuracy against the same model unquantized in float32, in
the same run, and HF transformers' figures on the same weights (``--hf``): perplexity on
``data/eval_text.txt`` (one prefill pass; Jelinek et al. 1977, as llama.cpp's
``llama-perplexity`` without its windowing) and greedy agreement on the chat prompts of
``data/chat_prompts.txt`` (mean and min). How each engine runs: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import time

import torch

from pagedllm.worker.prefill import calibrate_smoothquant, prefill_logits
from pagedllm.entrypoints.cli import HelpFormatter

from .report import output_file, save_json
from .serve_options import positive_int

EVAL_TEXT_PATH = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")
CHAT_PROMPTS_PATH = os.path.join(os.path.dirname(__file__), "data", "chat_prompts.txt")


def chat_prompts() -> list[str]:
    """The fixed greedy-agreement prompts (one user turn each), in file order."""
    with open(CHAT_PROMPTS_PATH, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def chat_prompt_ids(llm) -> list[list[int]]:
    """Each of ``chat_prompts()`` as one user turn rendered with ``llm``'s chat template (plain
    text without one): token ids, the same for every engine compared."""
    eng = llm.llm_engine
    if not getattr(eng.tokenizer, "chat_template", None):
        return [eng.tokenizer.encode(p) for p in chat_prompts()]
    return [eng.apply_chat_template([{"role": "user", "content": p}], True, None, None) for p in chat_prompts()]


def eval_text() -> str:
    """The fixed perplexity text (UTF-8)."""
    with open(EVAL_TEXT_PATH, encoding="utf-8") as f:
        return f.read()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean over t >= 1 of -log p(ids[t] | ids[:t])), with p the softmax of
    ``logits[t - 1]`` (float32 [T, vocab]). Raises ValueError for fewer than 2 tokens."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).mean()
    return float(torch.exp(nll))


def greedy_agreement(ref: list[int], out: list[int], eos_token_ids=(), max_tokens: int | None = None) -> int:
    """Leading tokens of ``out`` equal to ``ref``'s (the shorter length when one is a prefix of
    the other). With ``eos_token_ids`` both are cut after their first EOS, and continuations
    equal up to it agree in full (``max_tokens``, default ``len(ref)``). Why:
    docs/notes/benchmarks.md."""
    eos = set(eos_token_ids)
    if eos:
        ref, out = _cut_after_eos(ref, eos), _cut_after_eos(out, eos)
        if ref == out and ref and ref[-1] in eos:
            return max_tokens if max_tokens is not None else len(ref)
    n = 0
    for a, b in zip(ref, out):
        if a != b:
            break
        n += 1
    return n


def _cut_after_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return list(ids[:i + 1])
    return list(ids)


def model_perplexity(model_path: str | None, quantization: str | None, dtype: str = "float32",
                     text: str | None = None) -> tuple[float, int]:
    """(perplexity, tokens scored + 1) of the model at ``model_path`` (None = bundled) with
    ``quantization`` in ``dtype`` on the CPU over ``text`` (default the fixed text)."""
    from pagedllm.config import EngineArgs, EngineConfig
    from pagedllm.models.loader import build_model
    from pagedllm.tokenizer import get_tokenizer

    cfg = EngineConfig.from_args(EngineArgs(model=model_path, quantization=quantization, dtype=dtype,
                                            device="cpu"))
    ids = get_tokenizer(cfg.model_path).encode(text if text is not None else eval_text())
    model = build_model(cfg.model_path, cfg.arch, cfg.dtype, cfg.device, max(len(ids), 16),
                        quant_config=cfg.quant_config, calibrate=calibrate_smoothquant)
    try:
        return perplexity(prefill_logits(model, cfg.arch, ids, cfg.dtype, cfg.device), ids), len(ids)
    finally:
        del model
        gc.collect()


def greedy_outputs(llm, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuation token ids (``max_tokens`` each, EOS ignored) of each prompt
    (token ids) through ``llm`` (an ``LLM``), in order."""
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": i} for i in prompt_ids], sp, use_tqdm=False)]


def hf_perplexity(model, ids: list[int]) -> float:
    """``perplexity`` of a HF transformers causal LM over ``ids`` (one forward pass)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    return perplexity(logits.cpu(), ids)


def hf_greedy_outputs(model, prompt_ids: list[list[int]], max_tokens: int,
                      eos_token_ids: list[int] | None = None) -> list[list[int]]:
    """HF ``generate`` greedy continuations of up to ``max_tokens``, ending at an EOS
    (``eos_token_ids``; default the model's), one prompt at a time (no padding)."""
    outs = []
    kw = {} if eos_token_ids is None else {"eos_token_id": list(eos_token_ids)}
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids], device=model.device)
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                               pad_token_id=0, **kw)
            outs.append(y[0, len(ids):].tolist())
    return outs


def register(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("accuracy", help="perplexity and greedy agreement of a dtype, quantization "
                              "methods and KV-cache dtypes against float32 (and HF transformers with --hf)",
                              formatter_class=HelpFormatter)
    p.add_argument("--model", default=None,
                   help="a .gguf file or HF directory (default: the bundled model)%(default).0s")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the compared engines' dtype (the reference is always our float32 engine)")
    p.add_argument("--quantization", "-q", nargs="*", default=["int8", "gguf"],
                   help="methods to compare with the unquantized float32 model (-q alone: none)")
    p.add_argument("--kv-cache-dtype", nargs="*", default=[],
                   help="KV-cache dtypes to compare too (greedy agreement; unquantized weights)")
    p.add_argument("--hf", action="store_true",
                   help="also HF transformers in --dtype on the same weights (perplexity, greedy generate, one "
                        "prompt at a time: in bfloat16 on the CPU torch's own bf16 matmuls run it, ~1.5 min on "
                        "a quiet 2-core Zen 4, far longer on a busy one)")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="greedy tokens per prompt")
    p.add_argument("--output-json", default=None, type=output_file)
    p.set_defaults(func=accuracy_main)


def check_variants(quantization: list[str], kv_cache_dtypes: list[str], model: str | None = None,
                   dtype: str = "float32") -> None:
    """Check every ``--quantization`` and ``--kv-cache-dtype`` value before anything runs: a
    known name, and an engine config (``EngineConfig``, no weights read) that can start.

    Raises:
        ValueError: naming the flag and the first unknown value, or the first engine's
            error (an ``InvalidParameterError`` naming the setting).
    """
    from pagedllm.config import KV_CACHE_DTYPES, EngineArgs, EngineConfig
    from pagedllm.layers.quantization import QUANTIZATION_METHODS

    for flag, values, known in (("--quantization", quantization, QUANTIZATION_METHODS),
                                ("--kv-cache-dtype", kv_cache_dtypes, KV_CACHE_DTYPES)):
        bad = [v for v in values if v not in known]
        if bad:
            raise ValueError(f"{flag}: unknown {bad[0]!r}; choose from {', '.join(known)}")
    EngineConfig.from_args(EngineArgs(model=model, dtype=dtype))
    for q in quantization:
        EngineConfig.from_args(EngineArgs(model=model, dtype=dtype, quantization=q))
    for k in kv_cache_dtypes:
        EngineConfig.from_args(EngineArgs(model=model, dtype=dtype, kv_cache_dtype=k))


def _ours(args, prompt_ids, quant, kv, dtype) -> tuple[float, list[list[int]]]:
    """(perplexity or NaN for a KV-cache row, greedy outputs) of our engine."""
    from pagedllm import LLM

    ppl = model_perplexity(args.model, quant, dtype)[0] if kv == "auto" else float("nan")
    extra = {} if kv == "auto" else {"kv_cache_dtype": kv}
    llm = LLM(model=args.model, dtype=dtype, quantization=quant, **extra)
    try:
        return ppl, greedy_outputs(llm, prompt_ids, args.max_tokens)
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def _hf(args, prompt_ids, dtype, eos_token_ids) -> tuple[float, list[list[int]]]:
    """(perplexity, greedy outputs) of HF transformers in ``dtype`` on the same weights."""
    from pagedllm.benchmarks.throughput import load_hf_model
    from pagedllm.tokenizer import get_tokenizer
    from pagedllm.utils import default_model_path

    model = load_hf_model(argparse.Namespace(model=args.model, dtype=dtype, device="cpu"))[0]
    try:
        ids = get_tokenizer(args.model or default_model_path()).encode(eval_text())
        return hf_perplexity(model, ids), hf_greedy_outputs(model, prompt_ids, args.max_tokens, eos_token_ids)
    finally:
        del model
        gc.collect()


def accuracy_main(args) -> int:
    """Run the comparison and print one line per variant. Returns 0."""
    from pagedllm import LLM
    from pagedllm.benchmarks.machine import machine_info

    check_variants(args.quantization, args.kv_cache_dtype, args.model, args.dtype)
    machine = machine_info()
    print(f"{machine['cpu']} ({' '.join(machine['isa'])}); {args.dtype} activations against float32; "
          f"{len(chat_prompts())} chat prompts x {args.max_tokens} greedy tokens")
    # (label, engine, quantization, kv-cache dtype, dtype); the first row is the reference
    variants = [("float32", "ours", None, "auto", "float32")]
    if args.dtype != "float32":
        variants.append((args.dtype, "ours", None, "auto", args.dtype))
    variants += [(q, "ours", q, "auto", args.dtype) for q in args.quantization]
    variants += [(f"kv {k}", "ours", None, k, args.dtype) for k in args.kv_cache_dtype]
    if args.hf:
        variants.append((f"HF {args.dtype}", "hf", None, "auto", args.dtype))
    llm = LLM(model=args.model, dtype="float32", max_model_len=512, kv_cache_memory="64MiB")
    try:
        prompt_ids, eos = chat_prompt_ids(llm), list(llm.llm_engine.eos_token_ids)
    finally:
        llm.shutdown()
        del llm
    rows, ref_out = [], None
    for label, engine, quant, kv, dtype in variants:
        t = time.perf_counter()
        ppl, out = (_hf(args, prompt_ids, dtype, eos) if engine == "hf"
                    else _ours(args, prompt_ids, quant, kv, dtype))
        ref_out = ref_out or out
        agree = [greedy_agreement(r, o, eos, args.max_tokens) for r, o in zip(ref_out, out)]
        row = {"variant": label, "engine": engine, "dtype": dtype, "perplexity": ppl, "agreement": agree,
               "mean_agreement": sum(agree) / len(agree), "min_agreement": min(agree),
               "seconds": time.perf_counter() - t}
        rows.append(row)
        base = rows[0]["perplexity"]
        if math.isnan(ppl):     # a KV-cache row: the perplexity pass has no cache dtype
            shown = "not measured (KV-cache row)"
        else:
            shown = f"{ppl:.3f}" + ("" if not rows[1:] else f" ({(ppl / base - 1) * 100:+.2f} %)")
        print(f"{label:>14}: perplexity {shown} | greedy agreement mean "
              f"{row['mean_agreement']:.1f} / {args.max_tokens}, min {row['min_agreement']} "
              f"| {row['seconds']:.0f} s", flush=True)
    if args.output_json:
        save_json({"machine": machine, "dtype": args.dtype, "max_tokens": args.max_tokens, "rows": rows},
                  args.output_json)
    return 0
