"""Mixture of experts: the ``FusedMoE`` layer, and small random-weight Mixtral and
Qwen3-MoE models against HF transformers.

- ``FusedMoE`` equals a naive per-token reference (softmax, top-k, renormalised or not,
  weighted sum of SwiGLU experts) on random shapes; per-expert and stacked loading give
  the same weights; each output row is bitwise independent of the batch around it;
- prefill logits of Mixtral and Qwen3-MoE (renormalised top-k or not, a dense layer from
  ``mlp_only_layers``) equal transformers' in float32, loaded from the per-expert
  safetensors transformers 5.24 writes and from its fused 3-D in-memory layout;
- the engine's greedy continuations equal transformers' ``generate``, and do not change
  with batching, chunked prefill, prefix caching or preemption; every KV block is free
  afterwards;
- a GGUF written from the same weights (llama.cpp's tensor names, q/k permuted for the
  ``llama`` arch; stacked and per-expert experts) gives the logits of the safetensors
  directory, and ``llama`` with ``expert_count`` reads as Mixtral;
- ``--quantization`` quantizes the experts where it can and names the layer where it
  cannot; an unsupported MoE architecture is an error that names it.

Models: 2-3 layers, hidden 64, 4-8 experts, top-2/3, vocabulary 512, the bundled
tokenizer (prompts are token ids below 512).
"""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from engine_helpers import assert_greedy_invariant, engine_leaks, greedy
from model_helpers import load_hf
from pagedllm.worker.prefill import calibrate_smoothquant, prefill_logits
from pagedllm.layers.fused_moe import FusedMoE, select_experts
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.loader import load_arch_config
from pagedllm.models.loader import build_model
from pagedllm.platform import has_native_bf16

VOCAB = 512
CPU = torch.device("cpu")

# kind → (transformers config class name, its arguments)
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
KINDS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                                      rope_theta=10000.0)),
    "qwen3moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                        num_experts_per_tok=3, norm_topk_prob=True, head_dim=16)),
    "qwen3moe-nonorm": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2, norm_topk_prob=False, head_dim=16)),
    "qwen3moe-dense": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                              num_experts_per_tok=2, norm_topk_prob=True, head_dim=32,
                                              num_hidden_layers=3, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """``tiny(kind)`` → (HF directory, the transformers model), made once per module; weights
    ~N(0, 0.2), so that logits and routing are far from uniform."""
    made: dict[str, tuple[str, torch.nn.Module]] = {}

    def make(kind: str):
        if kind not in made:
            cls, kw = KINDS[kind]
            path = tiny_model_dir(cls, std=0.2, **{**_COMMON, **kw})
            made[kind] = path, load_hf(path)
        return made[kind]

    return make


def _ids(n: int, seed: int, lo: int = 4, hi: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _our_logits(path: str, ids: list[int]) -> torch.Tensor:
    """Prefill logits [T, vocab] of the model at ``path`` (HF directory or GGUF), float32,
    through the engine's model and paged attention."""
    cfg = load_arch_config(path)
    model = build_model(path, cfg, torch.float32, CPU, 512)
    return prefill_logits(model, cfg, ids, torch.float32, CPU, attention_backend="torch")


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _assert_close_to_hf(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < 1e-4 * max(1.0, ref.abs().max().item()), f"{what}: max |diff| {err}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), what


def _llm(path: str, **kw):
    from pagedllm import LLM

    base = dict(model=path, dtype="float32", device="cpu", seed=0, engine_process=False,
                max_model_len=256, kv_cache_memory="32MiB")
    return LLM(**{**base, **kw})


# -- FusedMoE ----------------------------------------------------------------------------
def _naive_moe(x, logits, w13, w2, k, renormalize):
    """Per token: softmax over the experts, top-k, weights (renormalised), sum of
    w * down(silu(gate x) * up x), in float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(logits[t].double(), -1)
        w, ids = torch.topk(p, k)
        if renormalize:
            w = w / w.sum()
        for wi, e in zip(w.tolist(), ids.tolist()):
            h = w13[e] @ x[t]
            out[t] += wi * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def _random_moe(E, k, H, inter, renormalize, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(E, H, inter, generator=g) * 0.2
    moe = FusedMoE(E, k, H, inter, renormalize, torch.float32, CPU, prefix="moe")
    moe.weight_loader(w13, "gate_up")                       # stacked, transformers 5's fused layout
    moe.weight_loader(w2, "down")
    return moe, w13, w2, g


def _prepare(module: torch.nn.Module) -> None:
    """What ``build_model`` does after loading: each linear method prepares its weights
    (oneDNN packing on the CPU), then the batch-invariance probe wraps what needs it."""
    from pagedllm.layers.batch_invariance import ensure_batch_invariant_linears

    for m in module.modules():
        if getattr(m, "linear_method", None) is not None:
            m.linear_method.process_weights_after_loading(m)
    ensure_batch_invariant_linears(module)


@pytest.mark.parametrize("E,k,T,H,inter,renormalize", [
    (4, 1, 7, 64, 32, True), (8, 2, 33, 64, 64, True), (8, 3, 1, 32, 48, False),
    (6, 6, 20, 64, 32, False), (16, 4, 50, 48, 32, True)])
def test_fused_moe_matches_naive_per_token_reference(E, k, T, H, inter, renormalize):
    moe, w13, w2, g = _random_moe(E, k, H, inter, renormalize, seed=E * 100 + T)
    # per-expert loading (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down) gives the same weights
    per_expert = FusedMoE(E, k, H, inter, renormalize, torch.float32, CPU, prefix="moe")
    for e in range(E):
        per_expert.weight_loader(w13[e, :inter], "gate", e)
        per_expert.weight_loader(w13[e, inter:], "up", e)
        per_expert.weight_loader(w2[e], "down", e)
    for e in range(E):
        assert torch.equal(per_expert.expert(e).gate_up_proj.weight, moe.expert(e).gate_up_proj.weight)
        assert torch.equal(per_expert.expert(e).down_proj.weight, moe.expert(e).down_proj.weight)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g) * 2
    ref = _naive_moe(x, logits, w13, w2, k, renormalize)
    _prepare(moe)
    with torch.inference_mode():
        out = moe(x, logits)
    assert out.dtype == torch.float32 and out.shape == (T, H)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_select_experts_normalisation():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, -1.0, 0.5, 0.7]])
    p = torch.softmax(logits, -1)
    w, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2], [0, 3]] and w.dtype == torch.float32
    torch.testing.assert_close(w, p.gather(1, ids))
    w_norm, ids_norm = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids_norm, ids)
    torch.testing.assert_close(w_norm, w / w.sum(-1, keepdim=True))
    torch.testing.assert_close(w_norm.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(4, 5, 64, 32, True, torch.float32, CPU)
    moe = FusedMoE(4, 2, 64, 32, True, torch.float32, CPU, prefix="m")
    with pytest.raises(ValueError, match="4 experts"):
        moe.weight_loader(torch.zeros(3, 64, 64), "gate_up")
    with pytest.raises(ValueError, match="m.3.down_proj"):
        moe.weight_loader(torch.zeros(64, 31), "down", 3)


@pytest.mark.parametrize("onednn", ["1", "0"])
def test_fused_moe_rows_independent_of_the_batch(monkeypatch, onednn):
    """Router and experts as the engine runs them (weights prepared, probe applied): a
    token's output is the same bits alone, in a batch of 2, 16 or 257 tokens, wherever it
    sits in the batch, although the tokens per expert change with the batch. With
    ``PAGEDLLM_ONEDNN=0`` the experts' ``F.linear`` (MKL) rows depended on the row count
    on the AVX2 machine (M = 1..17) until the probe put them in fixed row chunks (or, where
they differ at a few small row counts only, padded those calls)."""
    from pagedllm.layers.batch_invariance import ensure_batch_invariant_linears, probe_row_invariance

    monkeypatch.setenv("PAGEDLLM_ONEDNN", onednn)
    E, k, H, inter = 8, 2, 64, 64
    moe, _, _, g = _random_moe(E, k, H, inter, True, seed=7)
    router = ReplicatedLinear(H, E, False, torch.float32, CPU, prefix="gate")
    router.weight.data.copy_(torch.randn(E, H, generator=g))
    block = torch.nn.ModuleDict({"gate": router, "experts": moe})
    for m in block.modules():
        if getattr(m, "linear_method", None) is not None:
            m.linear_method.process_weights_after_loading(m)
    rows = [1, 2, 3, 5, 8, 16, 17, 33, 64, 257]
    before = probe_row_invariance(lambda x: moe(x, router(x)), H, torch.float32, CPU, rows)
    probes = ensure_batch_invariant_linears(block)
    assert probe_row_invariance(lambda x: moe(x, router(x)), H, torch.float32, CPU, rows) == []
    # where rows did depend on the batch (F.linear on the AVX2 machine: M = 1..17), the
    # experts' shapes were wrapped, and that is what made them invariant
    if before:
        name = moe.expert(0).gate_up_proj.linear_method.name
        assert name.endswith("-row chunks") or name.endswith("rows padded")
        assert all(p.chunk_rows or p.min_rows for p in probes if p.failed_at)


# -- models against transformers --------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_logits_match_transformers(tiny, kind):
    path, ref_model = tiny(kind)
    cfg = load_arch_config(path)
    assert cfg.num_experts == ref_model.config.num_local_experts
    assert cfg.norm_topk_prob == getattr(ref_model.config, "norm_topk_prob", True)
    model = build_model(path, cfg, torch.float32, CPU, 512)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    want = ["LlamaMLP" if i in getattr(ref_model.config, "mlp_only_layers", []) else "SparseMoeBlock"
            for i in range(cfg.num_hidden_layers)]
    assert kinds == want
    for ids in _ids(2, seed=3, lo=20, hi=100):
        ours = prefill_logits(model, cfg, ids, torch.float32, CPU, attention_backend="torch")
        _assert_close_to_hf(ours, _hf_logits(ref_model, ids), kind)


def test_fused_3d_safetensors_layout_loads_alike(tiny, tmp_path):
    """transformers 5's in-memory names (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]), saved as they are, load to the same logits as
    the per-expert files ``save_pretrained`` writes."""
    from safetensors.torch import save_file

    path, ref_model = tiny("qwen3moe")
    sd = {n: t.contiguous() for n, t in ref_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(sd, str(fused / "model.safetensors"))
    shutil.copy(f"{path}/config.json", fused / "config.json")
    ids = _ids(1, seed=5, lo=40, hi=41)[0]
    torch.testing.assert_close(_our_logits(str(fused), ids), _our_logits(path, ids), atol=0, rtol=0)


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe-dense"])
def test_engine_greedy_equals_transformers_generate(tiny, kind):
    path, ref_model = tiny(kind)
    prompts = _ids(3, seed=11)
    llm = _llm(path)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(12), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert list(o.outputs[0].token_ids) == _hf_greedy(ref_model, p, 12)
        assert engine_leaks(llm) == []
    finally:
        llm.shutdown()


# -- engine invariants ------------------------------------------------------------------
@pytest.mark.parametrize("kind,dtype", [("mixtral", "float32"), ("qwen3moe-dense", "float32")]
                         + ([("mixtral", "bfloat16")] if has_native_bf16() else []))
def test_greedy_unchanged_by_batching_chunking_caching_and_preemption(tiny, kind, dtype):
    path, _ = tiny(kind)
    shared = list(range(100, 140))                  # a 40-token prefix shared by four prompts
    prompts = [{"prompt_token_ids": p} for p in _ids(10, seed=1)]
    prompts += [{"prompt_token_ids": shared + p[:8]} for p in _ids(4, seed=2)]
    alone = assert_greedy_invariant(lambda **kw: _llm(path, dtype=dtype, **kw), prompts, greedy(12), {
        "batched": {},
        "chunked": dict(max_num_batched_tokens=24),
        "cached": dict(enable_prefix_caching=True),
        "preempted": dict(num_gpu_blocks_override=12, max_model_len=96),
    })
    assert all(len(t) == 12 for t in alone)


# -- GGUF -------------------------------------------------------------------------------
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (``convert_hf_to_gguf.py: LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
               "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def _write_gguf(model, path: str, stacked: bool = True, expert_type=None) -> None:
    """A GGUF of a transformers MoE model as llama.cpp's converter writes it: Mixtral as
    ``llama`` (q/k permuted), Qwen3-MoE as ``qwen3moe``; experts stacked
    (``ffn_*_exps``) or, with ``stacked=False``, one tensor per expert (older Mixtral
    files). ``expert_type``: a GGML type to quantize the experts to (else F32)."""
    import gguf

    c = model.config
    mixtral = c.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if not mixtral:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    inter = c.intermediate_size if mixtral else c.moe_intermediate_size

    def add(name, t):
        if expert_type is not None and re.match(r"blk\.\d+\.ffn_(gate|up|down)(_exps|\.\d+)\.weight$", name):
            w.add_tensor(name, gguf.quants.quantize(t, expert_type), raw_dtype=expert_type)
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))

    for name, t in model.state_dict().items():
        t = t.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            add({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name], t)
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if mixtral and rest == "self_attn.q_proj.weight":
            t = _permute(t, c.num_attention_heads)
        elif mixtral and rest == "self_attn.k_proj.weight":
            t = _permute(t, c.num_key_value_heads)
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            parts = ({"gate": t[:, :inter], "up": t[:, inter:]} if rest.endswith("gate_up_proj")
                     else {"down": t})
            for p, arr in parts.items():
                if stacked:
                    add(f"{blk}ffn_{p}_exps.weight", arr)
                else:
                    for e in range(arr.shape[0]):
                        add(f"{blk}ffn_{p}.{e}.weight", arr[e])
            continue
        add(blk + _GGUF_NAMES[rest], t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind,stacked", [("mixtral", True), ("mixtral", False), ("qwen3moe-dense", True)])
def test_gguf_logits_equal_safetensors(tiny, tmp_path, kind, stacked):
    path, ref_model = tiny(kind)
    gguf_path = str(tmp_path / "m.gguf")
    _write_gguf(ref_model, gguf_path, stacked=stacked)
    g, hf = load_arch_config(gguf_path), load_arch_config(path)
    for f in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
              "norm_topk_prob", "mlp_only_layers", "qk_norm", "head_dim"):
        assert getattr(g, f) == getattr(hf, f), f
    ids = _ids(1, seed=9, lo=50, hi=51)[0]
    ours = _our_logits(gguf_path, ids)
    torch.testing.assert_close(ours, _our_logits(path, ids), atol=1e-5, rtol=0)
    _assert_close_to_hf(ours, _hf_logits(ref_model, ids), f"{kind} gguf")


# -- quantization and errors ------------------------------------------------------------
@pytest.mark.parametrize("method", ["q8_0", "int8"])
def test_experts_take_float_weight_quantization(tiny, method):
    """The experts quantize like any linear layer (the router stays dense): one layer is
    within 8-bit rounding of the float reference; the whole model runs quantized."""
    from pagedllm.layers.quantization import get_quantization_config
    from pagedllm.platform import cpu_features

    if method == "int8" and not cpu_features().avx2:
        pytest.skip("int8 W8A8 needs AVX2 on the CPU")
    qc = get_quantization_config(method, device=CPU, dtype=torch.float32, gguf_tensor_types=None)
    _, w13, w2, g = _random_moe(8, 2, 64, 64, True, seed=1)
    moe = FusedMoE(8, 2, 64, 64, True, torch.float32, CPU, prefix="model.layers.0.mlp.experts", quant_config=qc)
    moe.weight_loader(w13, "gate_up")
    moe.weight_loader(w2, "down")
    _prepare(moe)
    x, logits = torch.randn(40, 64, generator=g), torch.randn(40, 8, generator=g)
    ref = _naive_moe(x, logits, w13, w2, 2, True).float()
    with torch.inference_mode():
        out = moe(x, logits)
    assert ((out - ref).norm() / ref.norm()).item() < 0.03    # measured 0.014 (q8_0), 0.016 (int8)

    path, ref_model = tiny("mixtral")
    cfg = load_arch_config(path)
    model = build_model(path, cfg, torch.float32, CPU, 512, quant_config=qc, calibrate=calibrate_smoothquant)
    block = model.model.layers[0].mlp
    expert_method = block.experts.expert(5).down_proj.linear_method.name
    assert expert_method == model.model.layers[0].self_attn.o_proj.linear_method.name
    assert block.gate.linear_method.name != expert_method
    ids = _ids(1, seed=4, lo=40, hi=41)[0]
    ours = prefill_logits(model, cfg, ids, torch.float32, CPU, attention_backend="torch")
    # random weights amplify the rounding through two layers (and a flipped expert choice
    # moves a position's logits a lot): most positions keep the float32 argmax
    assert (ours.argmax(-1) == _hf_logits(ref_model, ids).argmax(-1)).float().mean().item() >= 0.6


def test_gguf_packed_experts_are_refused_naming_the_layer(tiny, tmp_path):
    import gguf

    from pagedllm.errors import InvalidParameterError
    from pagedllm.layers.quantization import get_quantization_config
    from pagedllm.models.loader import gguf_tensor_types

    _, ref_model = tiny("mixtral")
    path = str(tmp_path / "q8.gguf")
    _write_gguf(ref_model, path, expert_type=gguf.GGMLQuantizationType.Q8_0)
    types = gguf_tensor_types(path)
    assert types["model.layers.0.mlp.experts.gate_proj.weight"] == "Q8_0"
    qc = get_quantization_config("gguf", device=CPU, dtype=torch.float32, gguf_tensor_types=types)
    with pytest.raises(InvalidParameterError, match="model.layers.0.mlp.experts") as err:
        build_model(path, load_arch_config(path), torch.float32, CPU, 256, quant_config=qc)
    assert err.value.param == "quantization"
    # without --quantization the Q8_0 experts are dequantized at load and the model runs
    ids = _ids(1, seed=6, lo=30, hi=31)[0]
    dequantized = _our_logits(path, ids)
    assert (dequantized.argmax(-1) == _hf_logits(ref_model, ids).argmax(-1)).float().mean().item() >= 0.8
    # one tensor per expert (older Mixtral files): each expert is a linear layer like any
    # other, so gguf keeps its Q8_0 blocks packed
    per_expert = str(tmp_path / "q8-per-expert.gguf")
    _write_gguf(ref_model, per_expert, stacked=False, expert_type=gguf.GGMLQuantizationType.Q8_0)
    types = gguf_tensor_types(per_expert)
    assert types["model.layers.1.mlp.experts.7.down_proj.weight"] == "Q8_0"
    qc = get_quantization_config("gguf", device=CPU, dtype=torch.float32, gguf_tensor_types=types)
    cfg = load_arch_config(per_expert)
    model = build_model(per_expert, cfg, torch.float32, CPU, 256, quant_config=qc)
    assert "Q8_0" in model.model.layers[1].mlp.experts.expert(7).down_proj.linear_method.name
    packed = prefill_logits(model, cfg, ids, torch.float32, CPU, attention_backend="torch")
    assert (packed.argmax(-1) == dequantized.argmax(-1)).float().mean().item() >= 0.8


def test_moe_architectures_are_registered_and_unknown_ones_named(tmp_path):
    import gguf

    from pagedllm.models.arch_config import ModelArchConfig
    from pagedllm.models.registry import architecture_for_gguf, describe_architectures

    rows = {r["architecture"]: r for r in describe_architectures()}
    assert rows["MixtralForCausalLM"]["moe"] == rows["Qwen3MoeForCausalLM"]["moe"] == "yes"
    assert rows["LlamaForCausalLM"]["moe"] == "no"
    assert architecture_for_gguf("llama") == "LlamaForCausalLM"
    assert architecture_for_gguf("llama", moe=True) == "MixtralForCausalLM"
    assert architecture_for_gguf("qwen3moe", moe=True) == "Qwen3MoeForCausalLM"
    cfg = ModelArchConfig("Qwen3MoeForCausalLM", 64, 96, 4, 4, 2, 16, VOCAB, num_experts=4,
                          num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]

    from pagedllm import LLM

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
        LLM(model=str(hf), engine_process=False)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "deepseek2")
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'deepseek2'"):
        load_arch_config(str(tmp_path / "m.gguf"))
