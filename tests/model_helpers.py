"""Tiny random-weight models for the tests: one recipe, saved once per configuration.

``save_tiny_model`` writes a seeded random-weight transformers model (safetensors,
float32) and, by default, the bundled model's tokenizer into a directory; the session
fixture ``tiny_model_dir`` (tests/conftest.py) calls it once per distinct setting and
hands every later caller the same directory. ``load_hf`` loads such a directory back as
the transformers reference (the same float32 weights, bit for bit).

Tests must not write into a directory they got from the factory (others share it): copy
it first (``shutil.copytree``) to change a file.
"""
from __future__ import annotations

import json
import os

# The bundled tokenizer's vocabulary (a directory that carries that tokenizer needs it).
VOCAB = 49152

# The suite's default tiny shape: 2 layers, hidden 256, 4 q / 2 kv heads x 64 (head_dim
# 64, so the attention kernel's vector path runs). Any field may be overridden.
TINY_CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)

# A smaller shape (hidden 64) for the architecture checks against transformers.
SMALL_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)

# Short names of the transformers config classes (a config class name works too).
ARCHS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "mixtral": "MixtralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "gemma3": "Gemma3TextConfig",
}

# One small model of each dense architecture the registry loads from a HF directory:
# name -> (arch, config over SMALL_CONFIG) (test_models_hf.py, test_fused_decoder.py).
ARCH_VARIANTS = {
    "llama": ("llama", dict(rope_theta=10000.0)),
    "llama3-scaled": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32)),
}


def tiny_model_key(arch: str = "llama", *, seed: int | None = 0, std: float | None = 0.1,
                   std_1d: float | None = None, tokenizer="bundled", **config) -> str:
    """A string that names one setting of ``save_tiny_model`` (the factory's cache key)."""
    tok = tokenizer if tokenizer in ("bundled", None) else f"object-{id(tokenizer)}"
    return json.dumps([arch, seed, std, std_1d, tok, {**TINY_CONFIG, **config}], sort_keys=True, default=repr)


def build_tiny_model(arch: str = "llama", *, seed: int | None = 0, std: float | None = 0.1,
                     std_1d: float | None = None, **config):
    """A random-weight transformers causal LM, float32, in eval mode.

    Args:
        arch: a key of ``ARCHS`` or a transformers config class name.
        seed: ``torch.manual_seed`` before the model is built (None: the RNG as it is);
            the global RNG is restored afterwards either way.
        std: weights with two or more dimensions are redrawn ~N(0, std) after the
            default init, so that logits are far from uniform (None: the default init).
        std_1d: the same for one-dimensional weights (norms, biases); None leaves them.
        config: config fields over ``TINY_CONFIG``.
    """
    import torch
    import transformers as tf

    cfg = getattr(tf, ARCHS.get(arch, arch))(**{**TINY_CONFIG, **config})
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in model.parameters():
                s = std if p.dim() > 1 else std_1d
                if s is not None:
                    p.normal_(0, s)
    return model


def save_tiny_model(path, arch: str = "llama", *, tokenizer="bundled", **kw):
    """``build_tiny_model(arch, **kw)`` saved (safetensors) into ``path`` with a tokenizer:
    "bundled" (the default model's), None (none), or an object with ``save_pretrained``.
    Returns the transformers model."""
    model = build_tiny_model(arch, **kw)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer == "bundled":
        from pagedllm.tokenizer import get_tokenizer

        get_tokenizer().save_pretrained(path)
    elif tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def load_hf(path: str):
    """The transformers model saved in ``path``, float32, in eval mode (the reference)."""
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tiny_arch_dir(tiny_model_dir, name: str) -> str:
    """The directory of ``ARCH_VARIANTS[name]`` (weights ~N(0, 0.2)), from the factory."""
    arch, kw = ARCH_VARIANTS[name]
    return tiny_model_dir(arch, std=0.2, **{**SMALL_CONFIG, **kw})
