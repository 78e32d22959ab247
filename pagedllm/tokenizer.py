"""Tokenizer loading (HF ``transformers``) for GGUF files and HF directories. A GGUF's
converted tokenizer is cached under ``$PAGEDLLM_CACHE``, keyed by path, size and mtime
(why: docs/notes/config.md).
"""
from __future__ import annotations

import hashlib
import logging
import os

logger = logging.getLogger("pagedllm")


def _cache_root() -> str:
    from pagedllm import envs

    return envs.cache_root()


def get_tokenizer(model: str | None = None):
    """A ``transformers`` fast tokenizer (with ``chat_template``) for ``model`` (.gguf or
    HF dir; None = the bundled SmolLM2 GGUF).

    Raises:
        FileNotFoundError: the model path does not exist.
    """
    from transformers import AutoTokenizer

    from pagedllm.utils import default_model_path

    path = model or default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = os.path.join(_cache_root(), "tokenizers", key)
    if os.path.exists(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception as e:  # a damaged cache is rebuilt below
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cache, e)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                        gguf_file=os.path.basename(path))
    try:
        tmp = cache + f".tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        os.replace(tmp, cache) if not os.path.exists(cache) else None
    except OSError as e:
        logger.warning("could not cache the tokenizer at %s: %s", cache, e)
    return tok


def eos_token_ids(tokenizer, model_eos: list[int], model_path: str) -> set[int]:
    """Ids that end generation: the model config's, the tokenizer's EOS, and a HF
    directory's generation_config.json ``eos_token_id`` (Llama 3 lists several)."""
    ids = set(model_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gc = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else None
    if gc and os.path.exists(gc):
        import json

        with open(gc) as f:
            e = json.load(f).get("eos_token_id")
        if e is not None:
            ids.update(e if isinstance(e, list) else [e])
    return ids
