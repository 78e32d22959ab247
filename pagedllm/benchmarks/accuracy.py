"""``pagedllm bench accuracy``: what a quantization method (``--quantization``) or a KV-cache
dtype (``--kv-cache-dtype``) costs in accuracy, against the same model unquantized in
float32, measured in the same run:

- perplexity on a fixed English text (``data/eval_text.txt``, ~450 tokens, written for
  this project): exp of the mean negative log-likelihood of each token given the ones
  before it, from one prefill pass over the whole text (Jelinek et al. 1977; the usual
  definition, as llama.cpp's ``llama-perplexity`` reports it, without its windowing);
- greedy agreement: for each prompt of a fixed set, how many leading tokens of the greedy
  continuation equal the float32 baseline's (``greedy_agreement``).

The perplexity pass builds the model with the engine's own loader and layers
(``models.registry.build_model`` with the method's ``QuantizationConfig``) and runs it over
a paged KV cache of its own, through the engine's attention backend for the dtype; the
greedy continuations run through ``LLM.generate``, so they include everything the engine
does (scheduling, batching, the KV-cache dtype).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import time

import torch

from pagedllm.worker.prefill import calibrate_smoothquant, prefill_logits

from .report import output_file, save_json
from .serve_options import positive_int

EVAL_TEXT_PATH = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")

#: Greedy-agreement prompts: chat turns and plain text, short and long.
AGREEMENT_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red:",
    "Once upon a time, in a small village by the mountains,",
    "Translate to French: The weather is nice today.",
    "What is 12 times 7? Answer:",
]


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


def greedy_agreement(ref: list[int], out: list[int]) -> int:
    """Leading tokens of ``out`` equal to ``ref``'s (0 when the first differs; the shorter
    length when one is a prefix of the other)."""
    n = 0
    for a, b in zip(ref, out):
        if a != b:
            break
        n += 1
    return n


def model_perplexity(model_path: str | None, quantization: str | None, dtype: str = "float32",
                     text: str | None = None) -> tuple[float, int]:
    """Perplexity of the model at ``model_path`` (None = the bundled one) with
    ``--quantization quantization`` in ``dtype`` on the CPU over ``text`` (default: the
    fixed text). Returns (perplexity, tokens scored + 1). Builds the model and frees it."""
    from pagedllm.config import EngineArgs, EngineConfig
    from pagedllm.models.registry import build_model
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


def greedy_outputs(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy continuation token ids of each prompt through ``llm`` (an ``LLM``), in order."""
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add ``accuracy`` to the ``bench`` sub-parsers; its ``func`` is :func:`accuracy_main`."""
    p = subparsers.add_parser("accuracy", help="perplexity and greedy agreement of quantization "
                              "methods against float32", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the bundled model)")
    p.add_argument("--quantization", "-q", nargs="+", default=["int8", "gguf"],
                   help="methods to compare with the unquantized float32 model")
    p.add_argument("--kv-cache-dtype", nargs="*", default=[],
                   help="KV-cache dtypes to compare too (greedy agreement; unquantized weights)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="greedy tokens per prompt")
    p.add_argument("--output-json", default=None, type=output_file)
    p.set_defaults(func=accuracy_main)


def check_variants(quantization: list[str], kv_cache_dtypes: list[str], model: str | None = None) -> None:
    """Check every ``--quantization`` and ``--kv-cache-dtype`` value before anything runs
    (a full comparison takes minutes): each is a known name, and each engine the
    comparison will start can start with ``model`` on this machine (``EngineConfig``,
    which reads the model's config but no weight).

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
    for q in quantization:
        EngineConfig.from_args(EngineArgs(model=model, dtype="float32", quantization=q))
    for k in kv_cache_dtypes:
        EngineConfig.from_args(EngineArgs(model=model, dtype="float32", kv_cache_dtype=k))


def accuracy_main(args) -> int:
    """Run the comparison and print one line per method. Returns 0."""
    from pagedllm import LLM
    from pagedllm.benchmarks.machine import machine_info

    check_variants(args.quantization, args.kv_cache_dtype, args.model)
    machine = machine_info()
    print(f"{machine['cpu']} ({' '.join(machine['isa'])}); float32 activations; "
          f"{len(AGREEMENT_PROMPTS)} prompts x {args.max_tokens} greedy tokens")
    rows = []
    variants = [("float32", None, "auto")] + [(q, q, "auto") for q in args.quantization] + \
               [(f"kv {k}", None, k) for k in args.kv_cache_dtype]
    ref_out = None
    for label, quant, kv in variants:
        t = time.perf_counter()
        ppl = model_perplexity(args.model, quant)[0] if kv == "auto" else float("nan")
        extra = {} if kv == "auto" else {"kv_cache_dtype": kv}
        llm = LLM(model=args.model, dtype="float32", quantization=quant, **extra)
        try:
            out = greedy_outputs(llm, AGREEMENT_PROMPTS, args.max_tokens)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
        ref_out = ref_out or out
        agree = [greedy_agreement(r, o) for r, o in zip(ref_out, out)]
        row = {"variant": label, "perplexity": ppl, "agreement": agree,
               "mean_agreement": sum(agree) / len(agree), "min_agreement": min(agree),
               "seconds": time.perf_counter() - t}
        rows.append(row)
        base = rows[0]["perplexity"]
        if math.isnan(ppl):     # a KV-cache row: the perplexity pass has no cache dtype
            shown = "not measured (KV-cache row)"
        else:
            shown = f"{ppl:.3f}" + ("" if not rows[1:] else f" ({(ppl / base - 1) * 100:+.2f} %)")
        print(f"{label:>12}: perplexity {shown} | greedy agreement mean "
              f"{row['mean_agreement']:.1f} / {args.max_tokens}, min {row['min_agreement']} "
              f"| {row['seconds']:.0f} s", flush=True)
    if args.output_json:
        save_json({"machine": machine, "max_tokens": args.max_tokens, "rows": rows}, args.output_json)
    return 0
