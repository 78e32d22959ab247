"""Every registered architecture against HF transformers on the same random weights,
loaded from a HF-format directory (config.json + model.safetensors + tokenizer files):
prefill logits through our paged attention equal transformers' logits."""
from __future__ import annotations

import pytest
import torch
from model_helpers import load_hf, tiny_arch_dir

from pagedllm.benchmarks.accuracy import prefill_logits
from pagedllm.models.loader import load_arch_config
from pagedllm.models.loader import build_model

@pytest.fixture(scope="module")
def tok():
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer()


def _our_prefill_logits(path: str, ids: list[int]) -> torch.Tensor:
    cfg = load_arch_config(path)
    model = build_model(path, cfg, torch.float32, torch.device("cpu"), 512)
    return prefill_logits(model, cfg, ids, torch.float32, torch.device("cpu"), attention_backend="torch")


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"])
def test_prefill_logits_match_transformers(tiny_model_dir, tok, arch):
    path = tiny_arch_dir(tiny_model_dir, arch)
    ref_model = load_hf(path)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 8)[:100]
    ours = _our_prefill_logits(path, ids)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < 1e-3 * max(1.0, ref.abs().max().item()), f"{arch}: max |diff| {err}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_engine_serves_hf_directory(tiny_model_dir, tok):
    """The whole engine on a HF directory (tokenizer and config from the directory): greedy
    tokens equal transformers' greedy generate on the same weights."""
    from pagedllm import LLM, SamplingParams

    path = tiny_arch_dir(tiny_model_dir, "qwen3")
    ref_model = load_hf(path)
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
