"""The model layers (pagedllm/layers/): each C++ path against its torch fallback, the two
linear methods against each other, the fused layers' weight loaders, the forward context,
and the architecture registry."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

from pagedllm.forward_context import get_forward_context, set_forward_context
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.layers import activation, describe_compute_path, layernorm, rotary_embedding
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import (MergedColumnParallelLinear, OneDNNPackedLinearMethod, QKVParallelLinear,
                                    ReplicatedLinear, UnquantizedLinearMethod, onednn_packing_available)
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.arch_config import ModelArchConfig

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture(scope="module")
def kernels():
    m = load_cpu_kernels()
    if m is None:
        pytest.skip("the C++ CPU kernels are unavailable (disabled or failed to build)")
    return m


def _both(monkeypatch, module, make):
    """(layer on the C++ path, the same layer built with the torch fallback)."""
    cpp = make()
    monkeypatch.setattr(module, "cpu_kernels_for", lambda device, dtype: None)
    return cpp, make()


def test_rms_norm_cpp_matches_torch(kernels, monkeypatch):
    cpp, ref = _both(monkeypatch, layernorm, lambda: layernorm.RMSNorm(576, 1e-5, F32, CPU))
    assert (cpp.compute_path, ref.compute_path) == (("rms_norm", "C++"), ("rms_norm", "torch"))
    g = torch.Generator().manual_seed(1)
    w = torch.rand(576, generator=g)
    cpp.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    x, res = torch.randn(19, 576, generator=g), torch.randn(19, 576, generator=g)
    want_h, want_res = ref(x.clone(), res.clone())
    x2, res2 = x.clone(), res.clone()
    h, new_res = cpp(x2, res2)
    assert h is x2 and new_res is res2                       # in place
    torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)   # the add is exact
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-6)
    # Without a residual both use torch; QK-norm normalises each head of [T, heads, head_dim].
    qk_norm = layernorm.RMSNorm(64, 1e-6, F32, CPU)
    q = torch.randn(5, 9, 64, generator=g)
    torch.testing.assert_close(qk_norm(q), q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_silu_and_mul_cpp_matches_torch(kernels, monkeypatch):
    cpp, ref = _both(monkeypatch, activation, lambda: activation.SiluAndMul(F32, CPU))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 3 * 100, generator=g) * 4)[:, :200]       # strided rows
    out = cpp(x)
    assert out.shape == (37, 100) and out.is_contiguous()
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)


def test_act_and_mul_by_hf_name():
    import torch.nn.functional as F

    assert type(activation.get_act_and_mul("silu", F32, CPU)) is activation.SiluAndMul
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    for name, approximate in (("gelu_pytorch_tanh", "tanh"), ("gelu", "none")):
        act = activation.get_act_and_mul(name, F32, CPU)
        assert type(act) is activation.GeluAndMul
        torch.testing.assert_close(act(x), F.gelu(x[:, :4], approximate=approximate) * x[:, 4:])
    with pytest.raises(ValueError, match="unsupported hidden activation 'relu'; supported: silu, "):
        activation.get_act_and_mul("relu", F32, CPU)


@pytest.mark.parametrize("adjacent", [True, False], ids=["qk-one-view", "qk-separate"])
def test_rotary_cpp_matches_torch(kernels, monkeypatch, adjacent):
    make = lambda: rotary_embedding.RotaryEmbedding(64, 128, 10000.0, None, F32, CPU)  # noqa: E731
    cpp, ref = _both(monkeypatch, rotary_embedding, make)
    g = torch.Generator().manual_seed(2)
    T, nh, nkv, hd = 13, 9, 3, 64
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=g)
    pos = torch.randint(0, 128, (T,), generator=g)

    def split(t):
        q = t[:, : nh * hd].view(T, nh, hd)
        k = t[:, nh * hd: (nh + nkv) * hd].view(T, nkv, hd)
        return (q, k) if adjacent else (q.clone(), k.clone())   # clones: as after QK-norm

    assert (rotary_embedding._joint_view(*split(qkv)) is not None) == adjacent
    want_q, want_k = ref(pos, *split(qkv.clone()))
    v_before = qkv[:, (nh + nkv) * hd:].clone()
    q, k = split(qkv)
    got_q, got_k = cpp(pos, q, k)
    assert got_q is q and got_k is k                          # in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (nh + nkv) * hd:], v_before)   # v untouched


def test_rotary_tables_looked_up_once_per_step():
    rope = rotary_embedding.RotaryEmbedding(8, 32, 10000.0, None, F32, CPU)
    pos = torch.tensor([3, 4, 5])
    with set_forward_context(None):
        first = rope.tables(pos)
        assert all(a is b for a, b in zip(rope.tables(pos), first))          # later layers
        assert rope.tables(torch.tensor([3, 4, 5]))[0] is not first[0]     # other tensor
    with set_forward_context(None):
        pos[0] = 7                                         # a buffer refilled for the next step
        cos, _ = rope.tables(pos)
        assert torch.equal(cos, rope.cos[[7, 4, 5]])
    assert rope.tables(pos)[0] is not rope.tables(pos)[0]                   # outside a step


@pytest.mark.skipif(not onednn_packing_available(CPU, F32), reason="no oneDNN (or PAGEDLLM_ONEDNN=0)")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_packed_linear_matches_dense(rows):
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(96, 48, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 48, generator=g)
    dense = ReplicatedLinear(48, 96, True, F32, CPU, UnquantizedLinearMethod())
    packed = ReplicatedLinear(48, 96, True, F32, CPU, OneDNNPackedLinearMethod())
    for layer in (dense, packed):
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        layer.linear_method.process_weights_after_loading(layer)
    assert dense.weight.numel() == 96 * 48 and packed.weight.numel() == 0   # dense copy released
    assert packed.compute_path == ("linear", "oneDNN-packed", "linear")   # (kind, method, layer name)
    torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense(x), x @ w.T + b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_packing_available(CPU, F32), reason="no oneDNN (or PAGEDLLM_ONEDNN=0)")
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_packed_matches_dense(tied):
    g = torch.Generator().manual_seed(5)
    table, h = torch.randn(300, 32, generator=g), torch.randn(6, 32, generator=g)
    logits = {}
    for method in (UnquantizedLinearMethod(), OneDNNPackedLinearMethod()):
        emb = VocabParallelEmbedding(300, 32, F32, CPU)
        emb.weight.data.copy_(table)
        head = ParallelLMHead(300, 32, F32, CPU, emb if tied else None, method)
        if not tied:
            head.weight.data.copy_(table)
        method.process_weights_after_loading(head)
        if tied:   # the embedding still looks tokens up in its dense table
            assert torch.equal(emb(torch.tensor([0, 299])), table[[0, 299]])
        for n in (1, 6):
            logits[method.name, n] = head(h[:n])
            assert logits[method.name, n].dtype == torch.float32
    for n in (1, 6):
        torch.testing.assert_close(logits["oneDNN-packed", n], logits["F.linear", n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits["F.linear", n], h[:n] @ table.T, rtol=1e-5, atol=1e-5)


def test_qkv_and_merged_weight_loaders_place_shards():
    hd, nh, nkv, hidden = 4, 3, 1, 8
    qkv = QKVParallelLinear(hidden, hd, nh, nkv, True, F32, CPU, UnquantizedLinearMethod(),
                            prefix="model.layers.0.self_attn.qkv_proj")
    parts = {s: torch.full((n * hd, hidden), float(i)) for i, (s, n) in enumerate(zip("qkv", (nh, nkv, nkv)))}
    for shard in ("v", "q", "k"):                    # any order
        qkv.weight.weight_loader(qkv.weight, parts[shard], shard)
        qkv.bias.weight_loader(qkv.bias, parts[shard][:, 0] + 10, shard)
    assert torch.equal(qkv.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    assert qkv.bias.tolist() == [10.0] * 12 + [11.0] * 4 + [12.0] * 4
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight shard 'k': "
                                         r"shape \(8, 8\) != expected \(4, 8\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(8, hidden), "k")

    mlp = MergedColumnParallelLinear(hidden, [5, 5], False, F32, CPU, UnquantizedLinearMethod(),
                                     prefix="mlp.gate_up_proj")
    mlp.weight_loader(mlp.weight, torch.ones(5, hidden), 1)
    mlp.weight_loader(mlp.weight, torch.zeros(5, hidden), 0)
    assert mlp.weight[:5].eq(0).all() and mlp.weight[5:].eq(1).all()
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj\.weight shard 0: shape \(5, 7\)"):
        mlp.weight_loader(mlp.weight, torch.zeros(5, 7), 0)


def test_forward_context_only_inside_a_step():
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    with set_forward_context("outer"):
        with set_forward_context("inner"):
            assert get_forward_context().attn_metadata == "inner"
        assert get_forward_context().attn_metadata == "outer"
    with pytest.raises(RuntimeError):
        get_forward_context()
    attn = Attention(2, 4, 0.5, 1, 0, F32, CPU)
    q, kv = torch.zeros(3, 2, 4), torch.zeros(3, 1, 4)
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        attn(q, kv, kv)
    attn.backend = object()                            # bound, but no step running
    with pytest.raises(RuntimeError, match="no forward context"):
        attn(q, kv, kv)


def _tiny_cfg(**kw) -> ModelArchConfig:
    return ModelArchConfig(**{**dict(architecture="Qwen3ForCausalLM", hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=8, vocab_size=50, qk_norm=True), **kw})


def test_missing_and_misshapen_weights_are_named():
    from pagedllm.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(_tiny_cfg(), F32, CPU, 64)
    names = {"model.embed_tokens.weight": (50, 32), "model.norm.weight": (32,), "lm_head.weight": (50, 32)}
    for i in range(2):
        p = f"model.layers.{i}."
        names.update({p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
                      p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
                      p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
                      p + "self_attn.q_norm.weight": (8,), p + "self_attn.k_norm.weight": (8,),
                      p + "mlp.gate_proj.weight": (48, 32), p + "mlp.up_proj.weight": (48, 32),
                      p + "mlp.down_proj.weight": (32, 48)})
    weights = {n: torch.randn(s) for n, s in names.items()}
    model.load_weights(weights.items())               # complete: loads
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[32:48],
                       weights["model.layers.1.self_attn.k_proj.weight"])
    partial = {n: t for n, t in weights.items() if n != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 1 weights, e\.g\. \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match=r"weight model\.norm\.weight: shape \(31,\) != expected \(32,\)"):
        model.load_weights([("model.norm.weight", torch.zeros(31))])


def test_describe_compute_path_names_each_layer_kind():
    from pagedllm.models.llama import LlamaForCausalLM

    text = describe_compute_path(LlamaForCausalLM(_tiny_cfg(), F32, CPU, 64))
    kinds = [part.split(" ")[0] for part in text.split(", ")]
    assert kinds == ["linear", "rms_norm", "rotary", "silu_and_mul"], text
    # each linear layer by name, with its method (the dense LM head has its own)
    method = "oneDNN-packed" if onednn_packing_available(CPU, F32) else "F.linear"
    head = "oneDNN-packed" if method == "oneDNN-packed" else "dense W@h.T"
    expected = (f"linear {method} (qkv_proj o_proj gate_up_proj down_proj lm_head)" if head == method else
                f"linear {method} (qkv_proj o_proj gate_up_proj down_proj) / {head} (lm_head)")
    assert text.split(", ")[0] == expected, text
    cpp = load_cpu_kernels() is not None
    assert ("rms_norm C++" in text) == cpp and ("rotary C++" in text) == cpp


def test_model_file_imports_only_layers():
    """The model is built from pagedllm/layers/; the kernels' build module and the
    attention backends stay behind them."""
    src = pathlib.Path(__file__).parents[2] / "pagedllm" / "models" / "llama.py"
    mods = {n.module for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in mods if m.startswith(("pagedllm.kernels", "pagedllm.attention"))}, mods


def test_registry_is_the_one_list_of_architectures():
    from pagedllm.models import arch_config, loader, registry
    from pagedllm.models.llama import LlamaForCausalLM

    for name, info in registry.ARCHITECTURES.items():
        # a GGUF arch shared by a dense and a MoE architecture (llama, Mixtral) resolves by expert_count
        assert registry.architecture_for_gguf(info.gguf_arch, moe=info.moe) == name
        assert issubclass(registry.get_model_class(_tiny_cfg(architecture=name)), LlamaForCausalLM)
    assert arch_config._arch_flags("Qwen2ForCausalLM") == {"attention_bias": True, "qk_norm": False}
    assert registry.arch_info("MistralForCausalLM").gguf_rope_permuted
    assert not hasattr(arch_config, "GGUF_ARCH_TO_HF") and not hasattr(loader, "_arch_flags")
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'; supported: \[.*'LlamaForCausalLM', .*'MixtralForCausalLM', "):
        registry.arch_info("GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'; supported: \['gemma3', 'llama', 'mistral'"):
        registry.architecture_for_gguf("gpt2")
    # Reading a config imports no model code.
    code = ("import sys, pagedllm.models.arch_config, pagedllm.models.loader; "
            "print([m for m in sys.modules if m.startswith(('pagedllm.models.llama', 'pagedllm.layers'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
