"""Tensor parallelism end to end on two loopback worker processes (gloo): greedy tokens at
tp = 2 equal tp = 1's on the same weights for each kind of split (query and KV heads,
KV heads replicated, a padded vocabulary shard with tied embeddings, sliding windows and
q/k norms, MoE experts, GGUF blocks), and stay the same batched, alone and chunked; bad
splits are errors naming the flag; a dead rank fails the engine at once and leaves no
process behind."""
from __future__ import annotations

import os
import time

import pytest

from engine_helpers import engine_core, random_prompts, run_alone
from pagedllm import LLM, SamplingParams
from pagedllm.errors import EngineDeadError
from pagedllm.platform import has_native_bf16

pytestmark = pytest.mark.slow

VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
MODELS = {
    # query heads and KV heads split 2 + 2 / 1 + 1
    "llama": ("llama", dict(rope_theta=10000.0)),
    # one KV head, replicated on both ranks; 509 tokens: the second vocabulary shard padded; tied head
    "llama-kv1-tied": ("llama", dict(rope_theta=10000.0, num_key_value_heads=1, vocab_size=509,
                                     tie_word_embeddings=True)),
    "gemma3": ("gemma3", dict(num_hidden_layers=3, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              tie_word_embeddings=True, pad_token_id=0,
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "mixtral": ("mixtral", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                rope_theta=10000.0)),
    # q/k/v biases (split with their rows), tied head
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    # per-head q/k norms, head_dim 32
    "qwen3": ("qwen3", dict(head_dim=32)),
}


def _dir(tiny_model_dir, name: str) -> str:
    arch, kw = MODELS[name]
    return tiny_model_dir(arch, std=0.2, **{**SMALL, **kw})


def _llm(path: str, tp: int, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_memory": "16MiB", "engine_process": False, "num_threads": 1, **kw}
    return LLM(model=path, tensor_parallel_size=tp, **kw)


def _prompts(n: int = 6, vocab: int = VOCAB) -> list[dict]:
    return random_prompts(n, 3, vocab, min_len=4, max_len=40)


def _greedy(llm: LLM, prompts, max_tokens: int = 12, logprobs: int | None = None):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _worker_pids(llm: LLM) -> list[int]:
    ex = engine_core(llm.llm_engine).executor
    return [p.pid for p in ex._procs]


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("name,quant", [("llama", None), ("llama-kv1-tied", None), ("gemma3", None),
                                        ("mixtral", None), ("qwen2", None), ("qwen3", None), ("llama", "q8_0")])
def test_tp2_greedy_tokens_equal_tp1(tiny_model_dir, name, quant):
    path = _dir(tiny_model_dir, name)
    vocab = MODELS[name][1].get("vocab_size", VOCAB)
    prompts = _prompts(vocab=vocab)
    ref_llm = _llm(path, 1, quantization=quant)
    ref = _greedy(ref_llm, prompts, logprobs=2)
    ref_llm.shutdown()
    llm = _llm(path, 2, quantization=quant)
    pids = _worker_pids(llm)
    try:
        out = _greedy(llm, prompts, logprobs=2)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        # the same logits up to the order of the partial sums (float32)
        worst = max(abs(a[t].logprob - b[t].logprob)
                    for o, r in zip(out, ref) for a, b in zip(o.logprobs, r.logprobs) for t in a if t in b)
        assert worst < 2e-3, worst
        if name == "llama" and quant is None:
            # batched = alone, and chunked prefill (8-token chunks) = whole prompts
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            assert run_alone(llm, prompts[:3], params) == [o.token_ids for o in out[:3]]
    finally:
        llm.shutdown()
    assert _gone(pids)
    if name == "llama" and quant is None:
        # chunked prefill (8-token steps), a KV cache too small for every request at once
        # (preemption), and prompts that share a prefix cached by an earlier request
        shared = [{"prompt_token_ids": prompts[0]["prompt_token_ids"] * 2 + p["prompt_token_ids"][:5]}
                  for p in prompts]
        squeeze = _llm(path, 1, max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=12)
        try:
            want = [o.token_ids for o in _greedy(squeeze, prompts + shared, max_tokens=24)]
        finally:
            squeeze.shutdown()
        chunked = _llm(path, 2, max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=12)
        try:
            got = [o.token_ids for o in _greedy(chunked, prompts + shared, max_tokens=24)]
            stats = chunked.stats()
            assert got == want
            assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
        finally:
            chunked.shutdown()
        full = _llm(path, 1)
        try:   # and all of it equals the unhurried, unchunked engine
            assert [o.token_ids for o in _greedy(full, prompts + shared, max_tokens=24)] == want
        finally:
            full.shutdown()


def test_tp2_int8_quantizes_each_shard_and_is_batch_invariant(tiny_model_dir):
    """int8 scales each rank's shard on its own (per output row of its input features, per
    token of its activations), a finer quantization than tp = 1's: not tp = 1's tokens,
    but deterministic and the same batched or alone (the ranks' digests agree each step)."""
    path = _dir(tiny_model_dir, "llama")
    prompts = _prompts()
    llm = _llm(path, 2, quantization="int8")
    try:
        assert "int8" in llm.llm_engine.engine_core.info.compute_path
        batched = [o.token_ids for o in _greedy(llm, prompts)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert run_alone(llm, prompts, params) == batched
    finally:
        llm.shutdown()


@pytest.mark.skipif(not has_native_bf16(), reason="no native bfloat16 on this CPU")
def test_tp2_bfloat16_is_batch_invariant(tiny_model_dir):
    path = _dir(tiny_model_dir, "llama")
    prompts = _prompts()
    llm = _llm(path, 2, dtype="bfloat16")
    try:
        batched = [o.token_ids for o in _greedy(llm, prompts)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert run_alone(llm, prompts, params) == batched
    finally:
        llm.shutdown()


def test_split_the_model_cannot_take_is_an_error_naming_the_flag(tiny_model_dir):
    path = _dir(tiny_model_dir, "llama")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's attention heads"):
        _llm(path, 3)
    with pytest.raises(ValueError, match="distributed_executor_backend 'uni' runs one worker"):
        _llm(path, 2, distributed_executor_backend="uni")
    # 96 MLP features: 48 per rank, not whole 32-weight blocks (raised in a worker, re-raised here)
    odd = tiny_model_dir("llama", std=0.2, **{**SMALL, "intermediate_size": 96, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 splits .*down_proj's 96 input features into 48 "
                                         r"per rank, not a multiple of .*32-weight blocks"):
        _llm(odd, 2, quantization="q8_0")


def test_a_dead_rank_fails_the_engine_at_once_and_leaves_no_process(tiny_model_dir):
    path = _dir(tiny_model_dir, "llama")
    llm = _llm(path, 2)
    pids = _worker_pids(llm)
    try:
        assert len(_greedy(llm, _prompts(2))) == 2
        os.kill(pids[1], 9)
        t = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1's process exited"):
            _greedy(llm, _prompts(2))
        assert time.monotonic() - t < 3.0
    finally:
        llm.shutdown()
    assert _gone(pids)


def test_two_nodes_on_loopback_equal_one_process(tiny_model_dir):
    """Node 1 runs `pagedllm serve --headless` (rank 1); node 0 the engine (rank 0), both on
    127.0.0.1, reaching each other only through --master-addr/--master-port."""
    import subprocess
    import sys

    from pagedllm.executor.multiproc_executor import free_port

    path = _dir(tiny_model_dir, "llama")
    prompts = _prompts(4)
    ref_llm = _llm(path, 1)
    ref = [o.token_ids for o in _greedy(ref_llm, prompts)]
    ref_llm.shutdown()
    port = free_port()
    while any(_port_taken(port + k) for k in range(1, 4)):
        port = free_port()
    node = ["--model", path, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--num-threads", "1", "-tp", "2",
            "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    headless = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--headless",
                                 "--node-rank", "1", *node], start_new_session=True)
    try:
        llm = _llm(path, 2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
        try:
            assert [o.token_ids for o in _greedy(llm, prompts)] == ref
        finally:
            llm.shutdown()
        assert headless.wait(30) == 0     # its rank stopped at node 0's SHUTDOWN, and so did it
        # node 1 lost mid-run: node 0's rank fails its all-reduce, the engine fails at once
        headless = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--headless",
                                     "--node-rank", "1", *node], start_new_session=True)
        llm = _llm(path, 2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
        pids = _worker_pids(llm)
        try:
            os.killpg(headless.pid, 9)
            headless.wait(10)
            t = time.monotonic()
            with pytest.raises(EngineDeadError, match="out of step|exited"):
                _greedy(llm, prompts)
            assert time.monotonic() - t < 10
        finally:
            llm.shutdown()
        assert _gone(pids)
        # nodes started with other settings: refused, naming them
        headless = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--headless",
                                     "--node-rank", "1", *node[:3], "bfloat16", *node[4:]], start_new_session=True)
        with pytest.raises(ValueError, match="runs with other settings than node 0 .*dtype"):
            _llm(path, 2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, 9)
            headless.wait(10)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def test_a_server_killed_while_its_ranks_wait_for_other_nodes_leaves_nothing(tiny_model_dir):
    """Node 0 waits for a node 1 that never comes; its front end is killed: the engine
    process and its rank see their parent go and exit."""
    import subprocess
    import sys

    from pagedllm.executor.multiproc_executor import free_port

    path = _dir(tiny_model_dir, "llama")
    server = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", path,
                               "--dtype", "float32", "--kv-cache-memory", "16MiB", "--num-threads", "1", "-tp", "2",
                               "--nnodes", "2", "--master-port", str(free_port()), "--port", str(free_port())])
    try:
        deadline = time.monotonic() + 60
        below: list[int] = []
        while time.monotonic() < deadline and not any(
                "worker_proc" in open(f"/proc/{p}/cmdline").read() for p in below if os.path.exists(f"/proc/{p}")):
            time.sleep(0.5)
            below = _descendants(server.pid)
        assert below
        server.kill()
        server.wait(10)
        assert _gone(below, timeout=15)
    finally:
        if server.poll() is None:
            server.kill()


def test_a_rank_that_dies_while_the_engine_idles_fails_it_at_once(tiny_model_dir):
    """The engine core checks its ranks while idle: health turns dead within seconds,
    not at the next request."""
    from pagedllm.errors import EngineDeadError as Dead

    path = _dir(tiny_model_dir, "llama")
    llm = _llm(path, 2, engine_process=True)
    try:
        assert len(_greedy(llm, _prompts(2))) == 2
        ranks = [p for p in _descendants(llm.llm_engine.engine_core.pid)
                 if "worker_proc" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == 2
        os.kill(ranks[1], 9)
        deadline = time.monotonic() + 5
        while True:
            try:
                llm.llm_engine.check_health()
            except Dead:
                break
            assert time.monotonic() < deadline, "a dead rank went unnoticed while idle"
            time.sleep(0.1)
    finally:
        llm.shutdown()
    assert _gone(ranks)


def _port_taken(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_node_settings_that_do_not_fit_are_errors(tiny_model_dir):
    path = _dir(tiny_model_dir, "llama")
    with pytest.raises(ValueError, match="nnodes > 1 needs master_port"):
        _llm(path, 2, nnodes=2)
    with pytest.raises(ValueError, match="nnodes 2 does not divide tensor_parallel_size 3"):
        _llm(path, 3, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, 2\)"):
        _llm(path, 2, nnodes=2, node_rank=2, master_port=29500)
    with pytest.raises(ValueError, match="node_rank 1 runs no engine"):
        _llm(path, 2, nnodes=2, node_rank=1, master_port=29500)


def test_ray_executor_equals_one_process(tiny_model_dir):
    ray = pytest.importorskip("ray")
    path = _dir(tiny_model_dir, "llama")
    prompts = _prompts(4)
    ref_llm = _llm(path, 1)
    ref = [o.token_ids for o in _greedy(ref_llm, prompts)]
    ref_llm.shutdown()
    llm = _llm(path, 2, distributed_executor_backend="ray")
    try:
        assert "(ray)" in llm.llm_engine.engine_core.info.compute_path
        assert [o.token_ids for o in _greedy(llm, prompts)] == ref
    finally:
        llm.shutdown()
    assert not ray.is_initialized()     # the local cluster it started is stopped


def test_bundled_model_served_at_tp3_equals_tp1(monkeypatch):
    """SmolLM2-135M has 9 query and 3 KV heads: tp = 2 cannot split it (an error naming the
    flag), tp = 3 can; served over HTTP at tp = 3 (three ranks on this machine's cores, so
    oversubscription is allowed here), it answers as the engine at tp = 1 does."""
    import httpx

    from server_helpers import _Server

    monkeypatch.setenv("PAGEDLLM_ALLOW_CPU_OVERSUBSCRIPTION", "1")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's attention heads"):
        LLM(tensor_parallel_size=2, dtype="float32")
    questions = ["What is the capital of France?", "Name three primary colors."]
    ref_llm = LLM(dtype="float32", kv_cache_memory="64MiB", engine_process=False, max_model_len=512)
    try:
        ref = [o.outputs[0].text for o in ref_llm.chat(
            [[{"role": "user", "content": q}] for q in questions],
            SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)]
    finally:
        ref_llm.shutdown()
    srv = _Server(engine_kw=dict(model=None, tensor_parallel_size=3, engine_process=True, kv_cache_memory="64MiB",
                                 max_model_len=512))
    try:
        for q, want in zip(questions, ref):
            r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
                "model": srv.engine.model_name, "messages": [{"role": "user", "content": q}],
                "temperature": 0, "max_tokens": 24})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want
    finally:
        srv.stop()


def test_more_ranks_than_cores_is_an_error_naming_the_flag(tiny_model_dir, monkeypatch):
    from pagedllm import platform

    monkeypatch.setattr(platform, "usable_cores", lambda: 2)
    path = _dir(tiny_model_dir, "llama")
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 CPU ranks .* on 2 cores"):
        LLM(model=path, tensor_parallel_size=2, data_parallel_size=2, dtype="float32")


def test_master_address_and_port_come_from_torch_env_names(monkeypatch):
    from pagedllm.config import EngineArgs

    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29511")
    a = EngineArgs(tensor_parallel_size=2, nnodes=2)
    a.validate()
    assert (a.master_addr, a.master_port) == ("10.1.2.3", 29511)
    b = EngineArgs(tensor_parallel_size=2, nnodes=2, master_addr="h", master_port=4000)
    b.validate()
    assert (b.master_addr, b.master_port) == ("h", 4000)
    monkeypatch.setenv("MASTER_PORT", "x")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
        EngineArgs(tensor_parallel_size=2, nnodes=2).validate()
