"""The whole engine on the Triton attention backend, on the CPU in the Triton interpreter
(as ``tests/attention/test_triton_attention.py``, whose header says why the variable is set
before triton is imported): greedy tokens equal to the torch backend's with batching,
chunked prefill and prefix caching, and equal again when decode steps replay captured
"graphs" (a fake that re-runs the captured forward over the persistent buffers, so what a
CUDA graph would freeze at capture is frozen here too)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from engine_helpers import model_runner  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.worker.cuda_graph import CudaGraphStep, capture_sizes  # noqa: E402

IN_PROCESS = isinstance(tl.zeros, InterpretedFunction)
pytestmark = pytest.mark.slow


class RerunGraphs:
    """Replay = run the captured function again into its captured output."""

    def __init__(self):
        self.replayed: list[int] = []

    def capture(self, fn):
        out = fn()
        return (fn, out), out

    def replay(self, graph):
        fn, out = graph
        out.copy_(fn())
        self.replayed.append(out.shape[0])


def _prompts() -> list[dict]:
    rng = np.random.default_rng(5)
    shared = rng.integers(10, 40000, 24).tolist()
    return [{"prompt_token_ids": shared + rng.integers(10, 40000, int(n)).tolist()} for n in (3, 17, 40)]


def _generate(tiny_dir, backend: str, graphs: RerunGraphs | None = None) -> tuple[list[list[int]], str]:
    llm = LLM(model=tiny_dir, dtype="float32", device="cpu", engine_process=False, attention_backend=backend,
              max_model_len=128, kv_cache_memory="8MiB", max_num_seqs=4, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    try:
        runner = model_runner(llm.llm_engine)
        if graphs is not None:
            step = CudaGraphStep(runner.model, runner.input_buffers, runner.metadata_for_graph,
                                 runner.block_size, capture_sizes(4), graphs)
            step.capture()
            runner.compiled_step = step
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate(_prompts()[:1], sp, use_tqdm=False)          # the shared prefix into the cache
        outs = llm.generate(_prompts(), sp, use_tqdm=False)
        assert llm.stats().prefix_cache_hits > 0
        return [list(o.outputs[0].token_ids) for o in outs], runner.describe_compute_path()
    finally:
        llm.shutdown()


@pytest.fixture(autouse=True)
def _interpreted(request):
    if request.node.originalname != "test_in_a_fresh_process" and not IN_PROCESS:
        pytest.skip("triton was imported without TRITON_INTERPRET=1: test_in_a_fresh_process runs these")


def test_triton_backend_equals_torch_backend(tiny_dir):
    want, _ = _generate(tiny_dir, "torch")
    got, line = _generate(tiny_dir, "triton")
    assert line.startswith("attention backend triton (unified paged attention") and "Triton interpreter" in line
    assert got == want and all(len(t) == 6 for t in got)


def test_replayed_decode_steps_equal_eager(tiny_dir):
    want, _ = _generate(tiny_dir, "torch")
    graphs = RerunGraphs()
    got, line = _generate(tiny_dir, "triton", graphs)
    assert got == want
    # three decodes pad to 4; one alone (the first generate) replays size 1
    assert 4 in graphs.replayed and 1 in graphs.replayed
    assert "CUDA graphs for decode batches of 3 sizes up to 4" in line


def test_logprobs_alone_equal_batched_float16(tiny_dir):
    """Bitwise, in float16: each request's decode logprobs alone and in one batch (a request's
    attention never depends on its neighbours: the decodes run in a launch of their own, and
    split-K is decided per request)."""
    llm = LLM(model=tiny_dir, dtype="float16", device="cpu", engine_process=False, attention_backend="triton",
              max_model_len=512, kv_cache_memory="8MiB", max_num_seqs=4, enable_prefix_caching=False)
    try:
        prompts = _prompts()
        prompts[2]["prompt_token_ids"] = prompts[2]["prompt_token_ids"] * 7     # > 256 tokens: split
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)

        def lps(batch):
            return [[sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs]
                    for o in llm.generate(batch, sp, use_tqdm=False)]
        assert [lps([p])[0] for p in prompts] == lps(prompts)
    finally:
        llm.shutdown()


def test_in_a_fresh_process(request):
    """Where triton was imported without the interpreter, this file in a new process."""
    if IN_PROCESS:
        pytest.skip("Triton is interpreted in this process: the tests ran here")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "not test_in_a_fresh_process"], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=900, cwd=pathlib.Path(__file__).parents[2])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
