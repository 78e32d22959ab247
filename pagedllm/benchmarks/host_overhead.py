"""``pagedllm bench host-overhead``: host-side time per decode step (step − forward −
logits: scheduling, batch and metadata preparation, sampling, output processing,
detokenization), median over all-decode steps (ms), on a tiny random-weight Llama so
the matmuls cost little. Method: docs/notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from pagedllm.benchmarks.report import output_file, save_json
from pagedllm.benchmarks.serve_options import positive_int


def make_tiny_llama(path: str, vocab_size: int = 512, seed: int = 0) -> str:
    """Write a random-weight 2-layer Llama (hidden 64, 4 heads, 2 KV heads) and the bundled
    tokenizer into ``path``; returns ``path``."""
    import transformers as tf

    from pagedllm.tokenizer import get_tokenizer

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    get_tokenizer().save_pretrained(path)
    return path


def _find_runner(llm):
    """The in-process ModelRunner behind ``llm`` (built with ``engine_process=False``)."""
    obj = llm.llm_engine
    try:
        for part in "engine_core.engine_core.executor.driver_worker.model_runner".split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise RuntimeError("cannot find the model runner behind the LLM (is its core in process?)") from None
    return obj


def measure(num_requests: int, input_len: int, output_len: int, num_threads: int | None = None) -> dict:
    """Run the workload once; returns medians in ms over all-decode steps and step counts."""
    from pagedllm import LLM, SamplingParams

    if num_threads:
        torch.set_num_threads(num_threads)
    with tempfile.TemporaryDirectory() as d:
        # in process: the timing hooks go on the model module itself
        llm = LLM(model=make_tiny_llama(d), max_num_seqs=num_requests,
                  max_num_batched_tokens=max(2048, num_requests * input_len),
                  max_model_len=input_len + output_len + 16, kv_cache_memory="256MiB", engine_process=False)
    runner = _find_runner(llm)
    model = runner.model
    timing = {"fwd": 0.0, "logits": 0.0}
    t_start = [0.0]
    # the forward: the model module when it runs eagerly, and the compiled step (the CPU's
    # fused stack, CUDA graphs) where that runs it instead
    model.register_forward_pre_hook(lambda m, a: t_start.__setitem__(0, time.perf_counter()))
    model.register_forward_hook(
        lambda m, a, o: timing.__setitem__("fwd", timing["fwd"] + time.perf_counter() - t_start[0]))
    step = runner.compiled_step
    if step is not None:
        orig_run = step.run

        def timed_run(*args, **kwargs):
            t = time.perf_counter()
            out = orig_run(*args, **kwargs)
            if out is not None:
                timing["fwd"] += time.perf_counter() - t
            return out

        step.run = timed_run
    orig_logits = model.compute_logits

    def timed_logits(h):
        t = time.perf_counter()
        out = orig_logits(h)
        timing["logits"] += time.perf_counter() - t
        return out

    model.compute_logits = timed_logits
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, 500, size=(num_requests, input_len)).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    steps, fwd, logits, host = [], [], [], []
    while eng.has_unfinished_requests():
        timing["fwd"] = timing["logits"] = 0.0
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        # all-decode steps: every request got a token and none is still prefilling
        if len(outs) == num_requests and all(len(o.outputs[0].token_ids) > 1 for o in outs):
            steps.append(dt)
            fwd.append(timing["fwd"])
            logits.append(timing["logits"])
            host.append(dt - timing["fwd"] - timing["logits"])
    llm.shutdown()
    ms = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731
    return {"num_requests": num_requests, "decode_steps": len(steps), "step_ms": ms(steps),
            "forward_ms": ms(fwd), "logits_ms": ms(logits), "host_ms": ms(host),
            "threads": torch.get_num_threads()}


def register(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser("host-overhead", help="host-side time per decode step (tiny random model)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=positive_int, default=256)
    p.add_argument("--input-len", type=positive_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3, help="runs; the best (lowest host time) is kept")
    p.add_argument("--num-threads", type=positive_int, default=None)
    p.add_argument("--output-json", default=None, type=output_file)
    p.set_defaults(func=main)


def main(args) -> int:
    """Print the host-side decode-step time (ms) of ``--repeats`` runs and the best one."""
    from pagedllm.benchmarks.machine import machine_info

    runs = [measure(args.num_requests, args.input_len, args.output_len, args.num_threads)
            for _ in range(args.repeats)]
    for r in runs:
        print(json.dumps(r))
    best = min(runs, key=lambda r: r["host_ms"])
    result = {"machine": machine_info(), "runs": runs, "best": best}
    print(f"host-side time per decode step at {args.num_requests} requests: {best['host_ms']:.2f} ms "
          f"(step {best['step_ms']:.2f} ms, forward {best['forward_ms']:.2f} ms, "
          f"logits {best['logits_ms']:.2f} ms; median of {best['decode_steps']} steps)")
    if args.output_json:
        save_json(result, args.output_json)
    return 0
