"""Engine configuration: the knobs users set (EngineArgs, mirrored as CLI flags) and the
resolved config the engine runs with."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import msgspec
import torch

from pagedllm import envs, platform
from pagedllm.errors import InvalidParameterError
from pagedllm.kv_cache_interface import KVCacheConfig, make_kv_cache_config
from pagedllm.models.arch_config import ModelArchConfig
from pagedllm.utils import default_model_path, parse_size, resolve_device

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}

AUTO_DTYPE_SHAPE = (576, 1536)        # in -> out timed when no model shape is given (SmolLM2-135M's MLP)


def resolve_dtype(dtype: str, device: torch.device, arch: ModelArchConfig | None = None) -> torch.dtype:
    """The torch dtype for ``--dtype``. ``auto``: bfloat16 on CUDA with bf16 (else
    float16); on CPU ``platform.auto_cpu_dtype`` at ``arch``'s MLP shape. An ``auto`` choice
    the architecture does not run in (``ArchInfo.dtypes``) becomes float32.

    Raises:
        ValueError: unknown dtype name, or one ``arch``'s architecture does not run in
        (named, with the ones it does).
    """
    if dtype == "auto":
        if device.type == "cuda":
            chosen = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            from pagedllm.layers.linear import bf16_kernel_name, measure_linear_gflops

            shape = (arch.hidden_size, arch.intermediate_size) if arch is not None else AUTO_DTYPE_SHAPE
            chosen = platform.auto_cpu_dtype(*shape, measure=measure_linear_gflops,
                                             bf16_kernel=bf16_kernel_name(device)).dtype
        if arch is not None and str(chosen).replace("torch.", "") not in _arch_dtypes(arch):
            return torch.float32
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    if arch is not None and dtype not in _arch_dtypes(arch):
        raise ValueError(f"dtype {dtype!r} is not supported by {arch.architecture} (numerical "
                         f"overflow); use one of: {', '.join(_arch_dtypes(arch))}")
    return _DTYPES[dtype]


def _arch_dtypes(arch: ModelArchConfig) -> tuple[str, ...]:
    """The dtype names ``arch``'s architecture runs in (all, if unregistered)."""
    from pagedllm.models.registry import ALL_DTYPES, ARCHITECTURES

    info = ARCHITECTURES.get(arch.architecture)
    return info.dtypes if info is not None else ALL_DTYPES


# ``--kv-cache-dtype`` names (vLLM's, plus float32) -> the KV cache's torch dtype; None:
# the model's dtype. "fp8" is E4M3, as in vLLM.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | None = None,
                           attention_backend: str = "auto") -> torch.dtype:
    """The KV cache's element type for ``--kv-cache-dtype`` (``auto`` = ``model_dtype``).
    fp8 is OCP OFP8 (E4M3 max 448, E5M2 max 57344), stored as fp8(x / scale) with per-layer
    K and V scales (checkpoint's, else 1.0). ``device`` None = CPU; ``attention_backend``
    must be able to read the dtype.

    Raises:
        ValueError: an unknown name, or a backend that cannot use the cache dtype (both
            name ``kv_cache_dtype``).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidParameterError(
            "kv_cache_dtype", f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    dtype = KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype
    from pagedllm.attention.registry import attention_backend_class

    try:
        backend = attention_backend_class(attention_backend, device, model_dtype)
    except ValueError:
        return dtype    # an unknown backend is reported where the backend is made
    if dtype not in backend.kv_cache_dtypes:
        raise InvalidParameterError(
            "kv_cache_dtype", f"kv_cache_dtype {kv_cache_dtype!r} ({str(dtype).removeprefix('torch.')}) is not "
            f"supported by the {backend.name!r} attention backend")
    return dtype


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``--speculative-config`` (JSON with vLLM's keys and defaults, except the suffix
    cache's 1000: docs/notes/config.md) resolved by ``parse``. Methods: ``ngram``,
    ``suffix`` (SuffixDecoding, Oliaro et al. 2024), ``draft_model`` (``model`` = its path,
    same tokenizer). k = ``num_speculative_tokens`` per request and step; ``adaptive``
    lowers k on rejections; ``draft_arch`` is set by ``EngineConfig.from_args``, never JSON."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True
    draft_arch: ModelArchConfig | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a JSON string, a dict or a SpeculativeConfig (None stays None).

        Raises:
            InvalidParameterError("speculative_config"): bad JSON, an unknown key (named,
                with the known ones) or method, a value of the wrong type (its key named),
                a missing or non-positive ``num_speculative_tokens``, bad n-gram bounds, a
                key of another method, a draft model without ``model``.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value

        def bad(msg):
            return InvalidParameterError("speculative_config", f"speculative_config: {msg}")
        if isinstance(value, (str, bytes)):
            try:
                value = msgspec.json.decode(value)
            except msgspec.DecodeError as e:
                raise bad(f"not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise bad(f"must be a JSON object, got {type(value).__name__}")
        keys = [f for f in cls.__struct_fields__ if f != "draft_arch"]
        if "draft_arch" in value:
            raise bad(f"unknown key 'draft_arch' (the draft model's architecture is read from 'model'); "
                      f"known keys: {', '.join(keys)}")
        d = dict(value)
        method = d.get("method")
        if method not in SPECULATIVE_METHODS:
            raise bad(f"method must be one of {', '.join(SPECULATIVE_METHODS)}; got {method!r}")
        # vLLM's defaults that depend on other keys
        if method == "suffix" and "num_speculative_tokens" not in d:
            d["num_speculative_tokens"] = d.get("suffix_decoding_max_tree_depth", 24)
        if method == "ngram":
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo, hi = 2, 5
            d["prompt_lookup_min"], d["prompt_lookup_max"] = (hi if lo is None else lo), (lo if hi is None else hi)
        try:
            spec = msgspec.convert(d, cls)   # unknown keys, types, required keys
        except msgspec.ValidationError as e:
            msg = str(e)
            if "unknown field" in msg:
                msg += f"; known keys: {', '.join(keys)}"
            raise bad(msg) from None
        only = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft_model": ("model",),
                "suffix": tuple(k for k in keys if k.startswith("suffix_decoding_"))}
        for m, names in only.items():
            stray = sorted(k for k in names if k in value and m != method)
            if stray:
                raise bad(f"{', '.join(stray)} only apply to method {m!r}, not {method!r}")
        for name, lo in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                         ("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", 0)):
            v = getattr(spec, name)
            if v < lo:
                raise bad(f"{name} must be an int >= {lo}, got {v!r}")
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise bad(f"prompt_lookup_min ({spec.prompt_lookup_min}) > prompt_lookup_max ({spec.prompt_lookup_max})")
        for name, hi in (("suffix_decoding_max_spec_factor", float("inf")), ("suffix_decoding_min_token_prob", 1.0)):
            v = getattr(spec, name)
            if not 0 <= v <= hi:
                raise bad(f"{name} must be a number in [0, {hi}], got {v!r}")
        if method == "draft_model":
            if not spec.model:
                raise bad("method draft_model needs 'model' (the draft model's path)")
            if not os.path.exists(spec.model):
                raise bad(f"draft model path {spec.model!r} does not exist")
        return spec

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a request needs beyond this step's tokens (a draft model's k K/V)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


# --distributed-executor-backend: one worker in the engine's process, one process per rank,
# or one Ray actor per rank
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class EngineArgs:
    """Every engine setting; CLI flags are these names in kebab case (as ``vllm serve``).
    Meanings and defaults of each: docs/configuration.md. ``model`` None = the bundled
    SmolLM2-135M; ``kv_cache_memory`` bytes or e.g. "4GiB"; ``speculative_config`` JSON
    string or dict (``SpeculativeConfig``)."""

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
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    load_format: str = "auto"
    quantization: str | None = None
    speculative_config: str | dict | None = None
    chat_template: str | None = None
    seed: int = 0
    num_threads: int | None = None
    profile_dir: str | None = None
    disable_hybrid_kv_cache_manager: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int = 0    # set per engine by the data-parallel client
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None     # None: $MASTER_ADDR, else 127.0.0.1
    master_port: int | None = None     # None: $MASTER_PORT
    engine_process: bool = True

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        parser.add_argument("--model", default=None,
                            help="a .gguf file or HF model directory (default: the bundled "
                                 "SmolLM2-135M-Instruct)%(default).0s")
        parser.add_argument("--served-model-name", default=None,
                            help="the name /v1/models reports and requests use (default: the file or folder name)")
        parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                            help="weights and activations; auto: on the CPU bfloat16 where it has bf16 arithmetic and a "
                                 "timed linear at the model's shape is faster in it, else float32; on CUDA bfloat16, or float16 where it has none")
        parser.add_argument("--device", default=d.device,
                            help="auto, cpu or cuda[:N]")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="most tokens (prompt + output) per request (default: the model's context, lowered to what the KV cache holds)")
        parser.add_argument("--block-size", type=int, default=d.block_size,
                            help="tokens per KV-cache block")
        parser.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", default=d.kv_cache_memory,
                            help="KV cache size on CPU: bytes or e.g. 4GiB")
        parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                            help="share of GPU memory for weights and KV cache (CUDA)")
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                            help="an exact number of KV blocks (tests, debugging)")
        parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                            help="token budget per step")
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                            help="most requests running at once")
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                            default=d.enable_chunked_prefill,
                            help="split long prompts across steps")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=d.enable_prefix_caching,
                            help="reuse the KV blocks of shared prompt prefixes")
        parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                            help="KV cache element type: auto = the model's dtype; fp8 = fp8_e4m3 "
                                 "(per-layer k/v scales from the checkpoint, else 1.0)")
        parser.add_argument("--attention-backend", default=d.attention_backend,
                            help="auto (cpu_kernel on the CPU, triton on CUDA), cpu_kernel, triton or torch")
        parser.add_argument("--enforce-eager", action="store_true",
                            help="run every step eagerly: no CUDA graphs (CUDA only; the CPU never captures)")
        parser.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                            help="auto: the checkpoint's weights; dummy: config.json only, every weight "
                                 "seeded random on the device (benchmarks; unquantized only)")
        parser.add_argument("--quantization", "-q", default=None,
                            help="int8 (W8A8), gguf (keep a GGUF's Q8_0/Q4_0/Q4_1 blocks packed), "
                                 "q8_0, q4_0, q4_1 (quantize float weights at load); default: none")
        parser.add_argument("--chat-template", default=None,
                            help="a Jinja chat template, or a file holding one, used instead of the model's")
        parser.add_argument("--speculative-config", default=None,
                            help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                                 '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; methods: '
                                 'ngram, suffix, draft_model (with "model")')
        parser.add_argument("--seed", type=int, default=d.seed,
                            help="seed for requests that set none")
        parser.add_argument("--num-threads", type=int, default=None,
                            help="CPU threads (per rank with -tp/-dp); default: torch's, or the cores shared out over the ranks")
        parser.add_argument("--profile-dir", default=None,
                            help="write steps.jsonl and a torch.profiler trace here")
        parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                            help="keep every KV block of sliding-window layers (one block table for "
                                 "all layers) instead of releasing those out of the window")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                            help="split the model over this many ranks (worker processes)")
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                            help="run this many engine replicas (each its own process and model copy, "
                                 "with --tensor-parallel-size ranks each); requests go to the least loaded")
        parser.add_argument("--nnodes", type=int, default=d.nnodes,
                            help="machines the tensor-parallel ranks are spread over (an equal share each)")
        parser.add_argument("--node-rank", type=int, default=d.node_rank,
                            help="this machine's index; 0 runs the engine, the others `serve --headless`")
        parser.add_argument("--master-addr", default=None,
                            help="node 0's address, reachable from every node (default: $MASTER_ADDR, "
                                 "else 127.0.0.1)")
        parser.add_argument("--master-port", type=int, default=None,
                            help="node 0's ports: this one (torch.distributed) and the next three (the "
                                 "executor's sockets); default: $MASTER_PORT")
        parser.add_argument("--distributed-executor-backend", default=None, choices=list(EXECUTOR_BACKENDS),
                            help="uni: one worker in the engine process (default at tp 1); mp: one "
                                 "process per rank (default when tp > 1)")
        parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                            help="run the engine core in its own process (default); --no-engine-process "
                                 "keeps it in this one, for debugging")
        return parser

    @staticmethod
    def cli_message(error: Exception) -> str:
        """``error``'s CLI message: an ``InvalidParameterError`` naming a field here becomes
        ``"--flag-name: ..."`` (without repeating the name); others are unchanged."""
        msg = str(error)
        if not (isinstance(error, InvalidParameterError)
                and error.param in {f.name for f in dataclasses.fields(EngineArgs)}):
            return msg
        flag = f"--{error.param.replace('_', '-')}"
        for name in (flag, error.param):
            if msg.startswith(name) and msg[len(name):len(name) + 1] in (":", " "):
                msg = msg[len(name):].lstrip(": ")
                break
        return f"{flag}: {msg}"

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def _check_types(self) -> None:
        """Check each setting against its annotation (int for float ok, bool for a number
        not; path objects for ``model``/``profile_dir`` become strings; ``device`` may be a
        ``torch.device``).

        Raises:
            InvalidParameterError: naming the first setting of a wrong type.
        """
        import types
        import typing

        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            v, hint = getattr(self, f.name), hints[f.name]
            allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            if v is None and type(None) in allowed:
                continue
            if isinstance(v, bool):
                ok = bool in allowed
            elif isinstance(v, int):
                ok = int in allowed or float in allowed
            elif isinstance(v, os.PathLike):
                ok = f.name in ("model", "profile_dir")
                if ok:
                    setattr(self, f.name, os.fspath(v))   # the loaders take strings
            elif isinstance(v, torch.device):
                ok = f.name == "device"
            else:
                ok = isinstance(v, tuple(t for t in allowed if t is not type(None)))
            if not ok:
                names = {str: "a string", int: "an int", float: "a number", bool: "a bool", dict: "a dict",
                         type(None): "None"}
                want = " or ".join(names.get(t, t.__name__) for t in allowed)
                want += {"model": " (or a path object)", "profile_dir": " (or a path object)",
                         "device": " (or a torch.device)"}.get(f.name, "")
                raise InvalidParameterError(f.name, f"{f.name} must be {want}, got {type(v).__name__} {v!r}")

    def validate(self) -> None:
        """Raises ValueError (an ``InvalidParameterError``) naming the first bad setting."""
        self._check_types()

        def pos(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidParameterError(name, f"{name} must be a positive int, got {v!r}")
        for n in ("max_model_len", "block_size", "num_gpu_blocks_override",
                  "max_num_batched_tokens", "max_num_seqs", "num_threads", "tensor_parallel_size",
                  "data_parallel_size", "nnodes"):
            pos(n)
        if not (0 < self.gpu_memory_utilization <= 1):
            raise InvalidParameterError("gpu_memory_utilization", f"gpu_memory_utilization must be in (0, 1], "
                                                                  f"got {self.gpu_memory_utilization}")
        try:
            parse_size(self.kv_cache_memory)
        except ValueError as e:
            raise InvalidParameterError("kv_cache_memory", f"kv_cache_memory: {e}") from None
        from pagedllm.attention.registry import attention_backend_class

        try:
            attention_backend_class(self.attention_backend)
        except ValueError as e:
            raise InvalidParameterError("attention_backend", f"attention_backend: {e}") from None
        if self.quantization is not None:
            from pagedllm.layers.quantization import QUANTIZATION_METHODS

            if self.quantization not in QUANTIZATION_METHODS:
                raise InvalidParameterError(
                    "quantization", f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, or unset "
                    f"for the model's own weights; got {self.quantization!r}")
        self._check_load_format()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)   # raises, naming kv_cache_dtype
        SpeculativeConfig.parse(self.speculative_config)   # raises, naming speculative_config
        if self.chat_template is not None:
            load_chat_template(self.chat_template)   # raises, naming chat_template
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise InvalidParameterError(
                "distributed_executor_backend", f"distributed_executor_backend must be one of "
                f"{', '.join(EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}")
        if self.data_parallel_size > 1 and not self.engine_process:
            raise InvalidParameterError(
                "data_parallel_size", "data_parallel_size > 1 runs each engine in its own process; "
                "it cannot be combined with engine_process=False (--no-engine-process)")
        if self.nnodes > 1:
            self._check_nodes()
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "uni":
            raise InvalidParameterError(
                "distributed_executor_backend", "distributed_executor_backend 'uni' runs one worker; "
                f"tensor_parallel_size {self.tensor_parallel_size} needs 'mp' or 'ray'")

    def _check_load_format(self) -> None:
        """Raises InvalidParameterError("load_format"): an unknown format, or dummy weights
        with a quantization method (random weights are made unquantized)."""
        from pagedllm.models.loader import LOAD_FORMATS

        if self.load_format not in LOAD_FORMATS:
            raise InvalidParameterError("load_format", f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                                                       f"got {self.load_format!r}")
        if self.load_format == "dummy" and self.quantization is not None:
            raise InvalidParameterError("load_format", f"load_format 'dummy' makes unquantized random weights; "
                                                       f"it cannot be combined with quantization {self.quantization!r}")

    def _check_nodes(self) -> None:
        """Raises InvalidParameterError naming the first multi-node setting that does not fit."""
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidParameterError("node_rank", f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise InvalidParameterError("nnodes", f"nnodes {self.nnodes} does not divide tensor_parallel_size "
                                                  f"{self.tensor_parallel_size} (each node runs an equal share)")
        # torch.distributed's env:// variables fill what the flags leave out
        self.master_addr = self.master_addr or envs.master_addr() or "127.0.0.1"
        if self.master_port is None and envs.master_port() is not None:
            self.master_port = envs.master_port()
        if self.master_port is None or not 0 < self.master_port <= 65532:
            raise InvalidParameterError("master_port", "nnodes > 1 needs master_port (1-65532: it and the next "
                                                       f"three ports on master_addr), got {self.master_port}")
        if self.data_parallel_size > 1:
            raise InvalidParameterError("data_parallel_size", "data_parallel_size > 1 with nnodes > 1 is not "
                                                              "supported yet; run one data-parallel engine per node")
        if self.distributed_executor_backend == "uni":
            raise InvalidParameterError("distributed_executor_backend",
                                        "nnodes > 1 needs distributed_executor_backend 'mp'")

    @property
    def executor_backend(self) -> str:
        """The executor that runs the workers: the flag, else "mp" when tp > 1, else "uni"."""
        return self.distributed_executor_backend or (
            "mp" if self.tensor_parallel_size > 1 or self.nnodes > 1 else "uni")


def load_chat_template(value: str) -> str:
    """The Jinja chat template ``value`` names: the text of the file at that path, else
    ``value`` itself where it holds Jinja markup (as ``vllm serve --chat-template``).

    Raises:
        InvalidParameterError(param="chat_template"): a path that is not a readable file and
            not a template, or a template Jinja cannot parse."""
    import jinja2

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidParameterError("chat_template", f"chat_template: cannot read {value!r}: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise InvalidParameterError("chat_template", f"chat_template: {value!r} is neither a file nor a "
                                                     "Jinja template ({{ ... }} or {% ... %})")
    try:   # compiled as apply_chat_template compiles it (its {% generation %} tag, loop controls)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:   # another transformers: plain Jinja with loop controls
        import jinja2.ext
        import jinja2.sandbox

        def _compile_jinja_template(t):
            return jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).from_string(t)
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidParameterError("chat_template", f"chat_template: not a valid Jinja template: {e}") from None
    return text


@dataclass
class EngineConfig:
    """Resolved settings: model path found, dtype and device chosen, quantization checked."""

    args: EngineArgs
    model_path: str
    served_model_name: str
    arch: ModelArchConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int  # final after KV sizing (set by EngineCore)
    kv_cache_dtype: torch.dtype | None = None   # None: dtype (set by from_args)
    quant_config: object | None = None   # a layers.quantization.QuantizationConfig
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self):
        if self.kv_cache_dtype is None:
            self.kv_cache_dtype = self.dtype

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The layers' KV-cache groups (``kv_cache_interface``)."""
        return make_kv_cache_config(self.arch.layer_windows(), hybrid=not self.args.disable_hybrid_kv_cache_manager)

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineConfig:

        from pagedllm.models.loader import load_arch_config
        from pagedllm.models.registry import get_model_class

        args.validate()
        path = args.model or default_model_path()
        try:
            arch = load_arch_config(path)
        except ValueError as e:   # the loader does not know which flag gave the path
            raise InvalidParameterError("model", f"--model: {e}") from None
        get_model_class(arch)  # fail early on an unknown architecture
        device = resolve_device(args.device)
        # before the dtype, whose "auto" may time the machine's matmuls (seconds)
        quant_config = _quant_config(args.quantization, path, device)
        if quant_config is not None:   # a layer the method cannot serve: said now, not after loading
            quant_config.check_model(getattr(get_model_class(arch), "packed_modules_mapping", {}))
        dtype = resolve_dtype(args.dtype, device, arch)
        max_len = args.max_model_len or arch.max_position_embeddings
        if (arch.max_position_embeddings and max_len > arch.max_position_embeddings
                and not envs.allow_long_max_model_len()):
            raise InvalidParameterError(
                "max_model_len", f"max_model_len {max_len} is longer than the model's context "
                f"({arch.max_position_embeddings} positions); set PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                "to allow it anyway (outputs past the trained length may be garbage)")
        name = args.served_model_name or os.path.basename(os.path.normpath(path))
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device, args.attention_backend)
        spec = SpeculativeConfig.parse(args.speculative_config)
        if spec is not None and spec.method == "draft_model":
            try:
                draft_arch = load_arch_config(spec.model)
                get_model_class(draft_arch)
            except (OSError, ValueError) as e:
                raise InvalidParameterError(
                    "speculative_config", f"speculative_config: draft model {spec.model!r} cannot be "
                    f"loaded: {e}") from None
            if arch.sliding_window is not None and not args.disable_hybrid_kv_cache_manager:
                raise InvalidParameterError(
                    "speculative_config", "speculative_config: a draft model cannot share the block tables "
                    "of a model with sliding-window layers; add --disable-hybrid-kv-cache-manager")
            if draft_arch.vocab_size != arch.vocab_size:
                raise InvalidParameterError(
                    "speculative_config", f"speculative_config: the draft model's vocabulary "
                    f"({draft_arch.vocab_size}) differs from the target's ({arch.vocab_size}); "
                    "a draft model must share the target's tokenizer")
            spec = msgspec.structs.replace(spec, draft_arch=draft_arch)   # read once, here
        _check_tensor_parallel(args, arch, device, spec)
        return cls(args, path, name, arch, dtype, device, max_len, kv_dtype, quant_config, spec)


def _check_tensor_parallel(args: EngineArgs, arch: ModelArchConfig, device: torch.device,
                           spec: SpeculativeConfig | None) -> None:
    """Raises InvalidParameterError("tensor_parallel_size") when the model's heads, MLP
    features or the device count do not split over ``args.tensor_parallel_size`` ranks,
    before any process starts (the layers check the rest, such as GGUF block
    boundaries, as they are built); then shares the CPU cores out (``_share_cores``)."""
    tp = args.tensor_parallel_size
    if tp > 1:
        from pagedllm.distributed import divide, kv_head_shard

        divide(arch.num_attention_heads, tp, "attention heads")
        kv_head_shard(arch.num_key_value_heads, 0, tp)
        for what, n in (("intermediate size", arch.intermediate_size),
                        ("MoE intermediate size", getattr(arch, "moe_intermediate_size", None))):
            if n:
                divide(n, tp, what)
        if spec is not None and spec.method == "draft_model":
            raise InvalidParameterError("tensor_parallel_size", "tensor_parallel_size > 1 does not run a draft "
                                        "model yet; use the ngram or suffix method")
        if device.type == "cuda" and torch.cuda.device_count() < tp:
            raise InvalidParameterError("tensor_parallel_size", f"tensor_parallel_size {tp} needs {tp} GPUs, "
                                        f"{torch.cuda.device_count()} visible")
    if device.type == "cpu" and tp * args.data_parallel_size > 1:
        _share_cores(args)


def cpu_ranks_per_node(args: EngineArgs) -> int:
    """The CPU ranks (tensor x data parallel) one node runs."""
    return args.tensor_parallel_size // args.nnodes * args.data_parallel_size


def _share_cores(args: EngineArgs) -> None:
    """Give each CPU rank on this node (tensor x data parallel) its share of the cores as its
    threads when ``num_threads`` is unset; more ranks than cores is an error naming the
    larger flag unless ``PAGEDLLM_ALLOW_CPU_OVERSUBSCRIPTION=1``."""
    ranks = cpu_ranks_per_node(args)
    bind = envs.cpu_omp_threads_bind()
    if bind and args.tensor_parallel_size > 1:   # checked here, before any process starts
        from pagedllm.distributed.utils import parse_cpu_bind

        per_node = args.tensor_parallel_size // args.nnodes
        for rank in range(args.node_rank * per_node, (args.node_rank + 1) * per_node):
            parse_cpu_bind(bind, rank, args.tensor_parallel_size)
    cores = platform.usable_cores()
    if ranks > cores and not envs.allow_cpu_oversubscription():
        flag = "tensor_parallel_size" if args.tensor_parallel_size > 1 else "data_parallel_size"
        raise InvalidParameterError(
            flag, f"{flag}: {ranks} CPU ranks (tensor x data parallel) on {cores} cores would fight over them; "
                  "use fewer, or set PAGEDLLM_ALLOW_CPU_OVERSUBSCRIPTION=1")
    if args.num_threads is None:
        args.num_threads = max(1, cores // ranks)


def _quant_config(method: str | None, path: str, device: torch.device):
    """``--quantization``'s ``QuantizationConfig`` or None. Raises
    InvalidParameterError("quantization") when it cannot run here."""
    if method is None:
        return None
    from pagedllm.layers.quantization import get_quantization_config
    from pagedllm.models.loader import gguf_tensor_types, is_gguf

    return get_quantization_config(method, device=device,
                                   gguf_tensor_types=gguf_tensor_types(path) if is_gguf(path) else None)
