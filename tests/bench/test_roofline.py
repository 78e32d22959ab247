"""``bench roofline``: the bytes a decode step reads, computed by hand for Llama-3-8B's
shape, and a run on the CPU that reports every figure."""
from __future__ import annotations

import json

import pytest

from pagedllm.benchmarks import roofline
from pagedllm.entrypoints.cli import main
from pagedllm.models.arch_config import ModelArchConfig

LLAMA3_8B = ModelArchConfig(architecture="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            vocab_size=128256, rope_theta=500000.0)
# Meta's published parameter count of Llama-3-8B (untied embedding table and LM head)
LLAMA3_8B_PARAMS = 8_030_261_248


def test_weight_bytes_of_llama3_8b_by_hand():
    # per layer: q|k|v 4096 x (4096 + 2 x 1024), o 4096 x 4096, gate|up|down 3 x 4096 x 14336, 2 norms
    per_layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert per_layer == 218_112_000
    table = 128256 * 4096                      # the LM head, and the embedding table beside it
    read = 32 * per_layer + 4096 + table       # + the final norm
    assert read + table == LLAMA3_8B_PARAMS    # everything but the embedding table is read
    for batch in (1, 64):                      # + one embedding row per request, bf16
        assert roofline.weight_bytes(LLAMA3_8B, 2, batch) == 2 * (read + batch * 4096)
    assert roofline.weight_bytes(LLAMA3_8B, 2, 1) == 15_009_857_536


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_equal_our_models_parameters(tied):
    """Built on the meta device (no memory): every parameter, less the embedding table but
    one row when it is not the LM head too."""
    import dataclasses

    import torch

    from pagedllm.models.registry import get_model_class

    arch = dataclasses.replace(LLAMA3_8B, tie_word_embeddings=tied)
    model = get_model_class(arch)(arch, torch.bfloat16, torch.device("meta"), 64)
    n = sum(p.numel() for p in model.parameters())
    if not tied:
        assert n == LLAMA3_8B_PARAMS
        n -= model.model.embed_tokens.weight.numel()
    assert roofline.weight_bytes(arch, 2, 1) == 2 * (n + 4096)


def test_kv_bytes_by_hand():
    per_token = 32 * 2 * 8 * 128 * 2           # layers x (K, V) x kv heads x head_dim x bf16
    assert per_token == 131072
    assert roofline.kv_bytes(LLAMA3_8B, 2, [512, 600]) == 1112 * per_token
    assert roofline.decode_bytes(LLAMA3_8B, 2, 2, [512, 600]) == (roofline.weight_bytes(LLAMA3_8B, 2, 2)
                                                                  + 1112 * per_token)
    # a sliding-window layer reads at most its window; fp8 K/V one byte each
    local = ModelArchConfig(architecture="Gemma3ForCausalLM", hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                            vocab_size=100, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"])
    assert roofline.kv_bytes(local, 1, [10, 3]) == ((4 + 3) + (10 + 3)) * 2 * 1 * 16


def test_moe_refused():
    moe = ModelArchConfig(architecture="Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                          vocab_size=100, num_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        roofline.weight_bytes(moe, 2, 1)


def test_batch_list():
    assert roofline.batch_list("1,16,64,16") == [1, 16, 64]
    for bad in ("", "0,1", "a"):
        with pytest.raises(Exception, match="positive ints"):
            roofline.batch_list(bad)


def test_roofline_runs_on_the_cpu(tmp_path, capsys):
    from pagedllm.benchmarks.host_overhead import make_tiny_llama

    path = make_tiny_llama(str(tmp_path / "m"))
    out = tmp_path / "r.json"
    rc = main(["bench", "roofline", "--model", path, "--load-format", "dummy", "--device", "cpu",
               "--dtype", "float32", "--batch-sizes", "1,3", "--input-len", "20", "--output-len", "6",
               "--copy-mib", "16", "--compare-eager", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["copy_bandwidth_gb_s"] > 0 and r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert [(row["enforce_eager"], row["batch"]) for row in r["rows"]] == [(False, 1), (False, 3), (True, 1),
                                                                           (True, 3)]
    for row in r["rows"]:
        assert row["decode_steps"] == 6 - 1 - 2          # output - the prefill's token - warm-up
        assert 0 < row["efficiency"] <= 1.5 and row["step_ms"] > 0 and row["tokens_per_s"] > 0
        # contexts 20 + 3 .. 20 + 5 of the steps kept: mean 24 tokens a request
        want = roofline.weight_bytes(_arch(path), 4, row["batch"]) + row["batch"] * 24 * r["kv_bytes_per_token"]
        assert row["bytes_per_step"] == pytest.approx(want)
    assert "efficiency" in capsys.readouterr().out


def _arch(path):
    from pagedllm.models.loader import load_arch_config

    return load_arch_config(path)
