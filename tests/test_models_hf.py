"""Every registered architecture against HF transformers on the same random weights,
loaded from a HF-format directory (config.json + model.safetensors + tokenizer files):
prefill logits through our paged attention equal transformers' logits."""
from __future__ import annotations

import pytest
import torch

from pagedllm.benchmarks.accuracy import prefill_logits
from pagedllm.models.loader import load_arch_config
from pagedllm.models.loader import build_model

VOCAB = 49152  # the bundled tokenizer's, so the directory can carry it


def _tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama3-scaled":
        return tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    raise ValueError(arch)


@pytest.fixture(scope="module")
def tok():
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer()


def _save_tiny(tmp_path, arch: str, tok):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _tiny_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-init weights so logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" not in str(p):
                pass
    path = tmp_path / arch
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path), model


def _our_prefill_logits(path: str, ids: list[int]) -> torch.Tensor:
    cfg = load_arch_config(path)
    model = build_model(path, cfg, torch.float32, torch.device("cpu"), 512)
    return prefill_logits(model, cfg, ids, torch.float32, torch.device("cpu"), attention_backend="torch")


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"])
def test_prefill_logits_match_transformers(tmp_path, tok, arch):
    path, ref_model = _save_tiny(tmp_path, arch, tok)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 8)[:100]
    ours = _our_prefill_logits(path, ids)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < 1e-3 * max(1.0, ref.abs().max().item()), f"{arch}: max |diff| {err}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_engine_serves_hf_directory(tmp_path, tok):
    """The whole engine on a HF directory (tokenizer and config from the directory): greedy
    tokens equal transformers' greedy generate on the same weights."""
    from pagedllm import LLM, SamplingParams

    path, ref_model = _save_tiny(tmp_path, "qwen3", tok)
    llm = LLM(model=path, dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=256)
    try:
        prompt = "Once upon a time"
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0]
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.prompt_token_ids == ids
    finally:
        llm.shutdown()


def test_unknown_architecture_is_a_clear_error(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTBigCodeForCausalLM"]}))
    from pagedllm import LLM

    with pytest.raises(ValueError, match="GPTBigCodeForCausalLM"):
        LLM(model=str(tmp_path))
