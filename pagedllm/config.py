"""Engine configuration: the knobs users set (EngineArgs, mirrored as CLI flags) and the
resolved config the engine runs with."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from pagedllm import envs
from pagedllm.errors import InvalidParameterError
from pagedllm.models.arch_config import ModelArchConfig
from pagedllm.platform import has_native_bf16
from pagedllm.utils import default_model_path, parse_size, resolve_device

logger = logging.getLogger("pagedllm")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on CUDA with bf16 support (else float16); on CPU bfloat16 only
    when the CPU computes in bf16 natively (AVX512-BF16/AMX), else float32.

    Raises:
        ValueError: unknown dtype name.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class EngineArgs:
    """Every engine setting; CLI flags are these names in kebab case (as ``vllm serve``).

    Attributes:
        model: path to a ``.gguf`` file or HF directory; None = the bundled SmolLM2-135M.
        served_model_name: name reported by /v1/models (default: the file/dir name).
        dtype: auto | float32 | bfloat16 | float16.
        device: auto | cpu | cuda[:N].
        max_model_len: most tokens (prompt + output) per request; None = the model's
            context length, capped by what the KV cache can hold.
        block_size: tokens per KV-cache block.
        kv_cache_memory: KV-cache size on CPU, bytes or "4GiB".
        gpu_memory_utilization: fraction of GPU memory the engine may use (CUDA).
        num_gpu_blocks_override: exact number of KV blocks (tests, debugging).
        max_num_batched_tokens: token budget per step.
        max_num_seqs: most requests running at once.
        enable_chunked_prefill: split long prompts across steps.
        enable_prefix_caching: reuse cached KV blocks across requests sharing a prefix.
        attention_backend: name of the attention backend; "auto" = "cpu_kernel" on the
            CPU (torch ops plus the C++ paged decode kernel, for float32 when it builds),
            "torch" on other devices.
        seed: global seed for unseeded sampling.
        num_threads: torch intra-op threads on CPU (None = torch's default).
        profile_dir: write a per-step JSONL log and a torch.profiler trace there.
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str | int = "4GiB"
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    profile_dir: str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        parser.add_argument("--model", default=None,
                            help="a .gguf file or HF model directory (default: the bundled "
                                 "SmolLM2-135M-Instruct)%(default).0s")
        parser.add_argument("--served-model-name", default=None)
        parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
        parser.add_argument("--device", default=d.device)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--block-size", type=int, default=d.block_size)
        parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                            help="KV cache size on CPU: bytes or e.g. 4GiB")
        parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
        parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                            default=d.enable_chunked_prefill)
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=d.enable_prefix_caching)
        parser.add_argument("--attention-backend", default=d.attention_backend)
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument("--num-threads", type=int, default=None)
        parser.add_argument("--profile-dir", default=None,
                            help="write steps.jsonl and a torch.profiler trace here")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting."""
        def pos(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for n in ("max_model_len", "block_size", "num_gpu_blocks_override",
                  "max_num_batched_tokens", "max_num_seqs", "num_threads"):
            pos(n)
        if not (0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        parse_size(self.kv_cache_memory)


@dataclass
class EngineConfig:
    """Resolved settings (model path found, dtype and device chosen)."""

    args: EngineArgs
    model_path: str
    served_model_name: str
    arch: ModelArchConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int  # final after KV sizing (set by EngineCore)

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineConfig:

        from pagedllm.models.loader import load_arch_config
        from pagedllm.models.registry import get_model_class

        args.validate()
        path = args.model or default_model_path()
        arch = load_arch_config(path)
        get_model_class(arch)  # fail early on an unknown architecture
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        max_len = args.max_model_len or arch.max_position_embeddings
        if (arch.max_position_embeddings and max_len > arch.max_position_embeddings
                and not envs.allow_long_max_model_len()):
            raise InvalidParameterError(
                "max_model_len", f"max_model_len {max_len} is longer than the model's context "
                f"({arch.max_position_embeddings} positions); set PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                "to allow it anyway (outputs past the trained length may be garbage)")
        name = args.served_model_name or os.path.basename(os.path.normpath(path))
        return cls(args, path, name, arch, dtype, device, max_len)
