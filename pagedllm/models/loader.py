"""Model loading: the architecture config and weights (HF names) of a GGUF file or HF
directory, and ``build_model``."""
from __future__ import annotations

import functools
import glob
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

from pagedllm.errors import InvalidParameterError
from pagedllm.models.arch_config import ModelArchConfig, config_from_gguf, config_from_hf_dir
from pagedllm.models.registry import arch_info, get_model_class

_GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the router [E, H], and every expert's projection stacked, experts
    # first ([E, I, H] gate and up, [E, H, I] down; split by ``layers/fused_moe.split_stacked``)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
# Older Mixtral GGUFs (before llama.cpp stacked the experts, 2024): one tensor per expert,
# ``ffn_{gate,up,down}.{e}.weight``.
_GGUF_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
# Where an architecture's llama.cpp names mean other HF modules: Gemma's ``ffn_norm`` is
# the norm before the MLP, and it has norms after attention and after the MLP too.
_GGUF_LAYER_OVERRIDES = {
    "Gemma3ForCausalLM": {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
_GGUF_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# ``--load-format``: the checkpoint's weights, or seeded random ones (``init_dummy_weights``).
LOAD_FORMATS = ("auto", "dummy")
# Standard deviation of the dummy weight matrices: HF's usual ``initializer_range``, which
# keeps a random model's activations and logits (std ~1) in range for a real-looking decode.
DUMMY_WEIGHT_STD = 0.02


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _gguf_reader(path: str):
    """A ``gguf.GGUFReader`` of ``path``, cached by size and mtime until the weights are read."""
    st = os.stat(path)
    return _cached_gguf_reader(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_gguf_reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


def load_arch_config(path: str) -> ModelArchConfig:
    """Architecture config of a ``.gguf`` file or HF directory.

    Raises:
        FileNotFoundError: no ``path``; ValueError: neither a ``.gguf`` file nor a directory."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if is_gguf(path):
        return config_from_gguf(_gguf_reader(path))
    if os.path.isdir(path):
        return config_from_hf_dir(path)
    raise ValueError(f"{path!r} is neither a .gguf file nor a HF model directory")


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py: LlamaModel.permute``)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, architecture: str | None = None) -> tuple[str | None, str]:
    """(HF name, GGUF per-layer suffix or "") of a GGUF tensor name; (None, "") if unused."""
    m = _BLK_RE.match(gguf_name)
    if m:
        layer, rest = m.groups()
        hf = _GGUF_LAYER_OVERRIDES.get(architecture, {}).get(rest) or _GGUF_LAYER_MAP.get(rest)
        if hf is None and (e := _GGUF_EXPERT_RE.match(rest)):
            hf = f"mlp.experts.{e.group(2)}.{e.group(1)}_proj.weight"
        if hf is None:
            return None, ""
        return f"model.layers.{layer}.{hf}", rest
    return _GGUF_GLOBAL_MAP.get(gguf_name), ""


def gguf_tensor_types(path: str) -> dict[str, str]:
    """HF name → GGML type name of every used tensor of the GGUF file ``path`` (header only)."""
    out = {}
    arch = load_arch_config(path).architecture
    for t in _gguf_reader(path).tensors:
        name, _ = _hf_name(t.name, arch)
        if name is not None:
            out[name] = t.tensor_type.name
    return out


def iter_gguf_weights(path: str, cfg: ModelArchConfig,
                      packed_types: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every used tensor of a GGUF file, in torch order
    ([out, in]; [experts, out, in]): ``packed_types`` as raw uint8 blocks, others
    dequantized to float32; q/k rows in HF's order."""
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    _cached_gguf_reader.cache_clear()   # the weights are read once; free the mapping after
    info = arch_info(cfg.architecture)
    permute, shift = info.gguf_rope_permuted, info.gguf_norm_shift
    for t in reader.tensors:
        name, rest = _hf_name(t.name, cfg.architecture)
        if name is None:
            continue
        shape = tuple(reversed([int(x) for x in t.shape]))
        if t.tensor_type.name in packed_types:
            arr = np.asarray(t.data, dtype=np.uint8).reshape(shape[0], -1)
        else:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if permute and rest in ("attn_q.weight", "attn_q.bias"):
            arr = _unpermute_rope(arr, cfg.num_attention_heads)
        elif permute and rest in ("attn_k.weight", "attn_k.bias"):
            arr = _unpermute_rope(arr, cfg.num_key_value_heads)
        if shift and name.endswith("norm.weight"):
            arr = arr - np.float32(shift)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, order="C", copy=True)
        yield name, torch.from_numpy(arr)


def iter_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` from every ``*.safetensors`` in ``path``; FileNotFoundError if none."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    for fn in files:
        with safe_open(fn, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_weights(path: str, cfg: ModelArchConfig,
                 packed_types: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Weights of a GGUF file or a HF directory, with HF names."""
    if is_gguf(path):
        return iter_gguf_weights(path, cfg, packed_types)
    return iter_safetensors_weights(path)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = DUMMY_WEIGHT_STD) -> None:
    """Fill every floating-point parameter in place on its own device (``--load-format
    dummy``): matrices ~N(0, ``std``), norm weights 1, other vectors (biases) 0; the same
    values for the same ``seed``, model and device."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        if p.dim() > 1:
            g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.normal_(0.0, std, generator=g)
        else:
            module, _, leaf = name.rpartition(".")
            p.fill_(1.0 if leaf == "weight" and "norm" in module.rpartition(".")[2] else 0.0)


def build_model(path: str, cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, quant_config=None, calibrate=None, load_format: str = "auto",
                seed: int = 0) -> torch.nn.Module:
    """Instantiate the registered class, load and prepare weights (calibrated layers after
    ``calibrate(model, layers, path, cfg, dtype, device, max_positions)``), then make linear
    outputs batch-invariant unless ``PAGEDLLM_BATCH_INVARIANT_PROBE=0``. ``load_format``
    "dummy": no checkpoint read, ``init_dummy_weights(model, seed)`` instead.

    Raises:
        ValueError: missing or mis-shaped weights; InvalidParameterError("quantization"):
            an unsupported layer, or calibration needed and no ``calibrate``;
            InvalidParameterError("load_format"): an unknown format, or "dummy" with a
            ``quant_config``."""
    from pagedllm import envs
    from pagedllm.layers.batch_invariance import ensure_batch_invariant_linears

    if load_format not in LOAD_FORMATS or (load_format == "dummy" and quant_config is not None):
        raise InvalidParameterError("load_format", f"load_format {load_format!r} is not one of "
                                    f"{', '.join(LOAD_FORMATS)}, or is 'dummy' with a quantization method")
    model_class = get_model_class(cfg)
    if load_format == "dummy":
        model = model_class(cfg, dtype, device, max_positions)
        init_dummy_weights(model, seed)
    elif quant_config is None:
        model = model_class(cfg, dtype, device, max_positions)
        model.load_weights(iter_weights(path, cfg))
    else:
        quant_config.packed_modules_mapping = getattr(model_class, "packed_modules_mapping", {})
        model = model_class(cfg, dtype, device, max_positions, quant_config=quant_config)
        model.load_weights(iter_weights(path, cfg, packed_types=quant_config.packed_gguf_types()))
    calibrated = []      # layers whose method needs activation statistics first (SmoothQuant)
    for module in model.modules():
        for attr in ("embedding_method", "linear_method"):
            method = getattr(module, attr, None)
            if method is None:
                continue
            if attr == "linear_method" and getattr(method, "needs_calibration", False):
                calibrated.append(module)
            else:
                method.process_weights_after_loading(module)
    if calibrated:
        if calibrate is None:
            raise InvalidParameterError(
                "quantization", f"{calibrated[0].linear_method.name} needs a calibration pass at load, "
                                "and build_model was given no calibrate function")
        calibrate(model, calibrated, path, cfg, dtype, device, max_positions)
        for module in calibrated:
            module.linear_method.process_weights_after_loading(module)
    if envs.batch_invariant_probe_enabled():
        ensure_batch_invariant_linears(model)
    return model.eval()
