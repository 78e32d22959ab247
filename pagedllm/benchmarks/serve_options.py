"""Options of ``pagedllm bench serve`` and ``bench sweep``: the flags, their argparse types,
the validated :class:`BenchConfig`, and the tokenizer and dataset they build. Errors name
their flag: ``argparse.ArgumentTypeError`` from argparse types, later :class:`BenchError`
or :class:`~pagedllm.benchmarks.datasets.DatasetError`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from .datasets import (
    Dataset,
    DatasetError,
    MultiTurnDataset,
    RandomDataset,
    ShareGPTDataset,
    SharedPrefixDataset,
    TokenSource,
)
from .argtypes import positive_int
from .cost import ApiPrice, add_cost_arguments
from .endpoints import ENDPOINT_TYPES
from .load_model import AbortPlan, add_load_model_arguments
from .metrics import DEFAULT_PERCENTILES, parse_slos
from .traces import TRACE_FORMATS, TraceDataset

__all__ = [
    "BenchConfig",
    "BenchError",
    "positive_float",
    "positive_int",
    "percentile_list",
    "json_object",
    "endpoint_types",
    "endpoint_kinds",
    "add_common_arguments",
    "add_serve_arguments",
    "config_from_args",
    "load_tokenizer",
    "build_dataset",
    "prepare",
    "DEFAULT_TOKENIZER_ID_LIMIT",
]

#: With the default (bundled) tokenizer the server may run another model: random
#: token ids stay below this, inside any common vocabulary.
DEFAULT_TOKENIZER_ID_LIMIT = 32000


class BenchError(Exception):
    """A benchmark could not be set up (bad option, unreachable model list)."""


@dataclass
class BenchConfig:
    """Options of one ``bench serve`` run: ``request_rate`` req/s (``inf`` = all at once);
    ``duration_s``, ``timeout_s``, ``retry_backoff_s`` seconds; ``goodput_ms`` SLO metric ->
    ms; ``num_prompts`` sessions; ``endpoint_type`` "auto" or one of
    :data:`~pagedllm.benchmarks.endpoints.ENDPOINT_TYPES`; ``cost_per_hour`` USD, ``api_price``,
    ``what_if_system_len`` for :mod:`~pagedllm.benchmarks.cost`; ``abort_fraction`` /
    ``abort_after`` the abandoned-stream model (``load_model``); ``progress`` live progress
    on stderr, titled ``progress_desc`` (None: "requests")."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str | None = None
    endpoint_type: str = "auto"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = None
    duration_s: float | None = None
    num_warmups: int = 0
    timeout_s: float = 600.0
    max_retries: int = 0
    retry_backoff_s: float = 0.25
    temperature: float = 0.0
    ignore_eos: bool = False
    stream_usage: bool = True
    extra_body: dict = field(default_factory=dict)
    goodput_ms: dict = field(default_factory=dict)
    percentiles: tuple = DEFAULT_PERCENTILES
    metrics_url: str | None = None
    scrape_metrics: bool = True
    seed: int = 0
    label: str | None = None
    quiet: bool = False
    prompt_format: str = "ids"
    cost_per_hour: float | None = None
    api_price: ApiPrice | None = None
    what_if_system_len: int | None = None
    abort_fraction: float = 0.0
    abort_after: str | None = None
    progress: bool = True
    progress_desc: str | None = None

    def validate(self) -> None:
        """Raise ``BenchError`` naming the flag of the first invalid option."""
        if not (self.request_rate > 0):
            raise BenchError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise BenchError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.duration_s is not None and not (self.duration_s > 0):
            raise BenchError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.num_warmups < 0:
            raise BenchError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not (self.timeout_s > 0):
            raise BenchError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.max_retries < 0:
            raise BenchError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.retry_backoff_s < 0:
            raise BenchError(f"--retry-backoff must be >= 0, got {self.retry_backoff_s}")
        if self.prompt_format not in ("ids", "text"):
            raise BenchError(f"--prompt-format must be ids or text, got {self.prompt_format!r}")
        if self.endpoint_type not in ("auto",) + ENDPOINT_TYPES:
            raise BenchError(f"--endpoint-type must be auto, {', '.join(ENDPOINT_TYPES)}; "
                             f"got {self.endpoint_type!r}")
        if self.ignore_eos and self.endpoint_type in ("responses", "messages"):
            raise BenchError(f"--ignore-eos: the {self.endpoint_type} API has no such field (its server answers "
                             "400 to unknown fields); compare APIs with greedy decoding instead (--temperature 0, "
                             "the default), which generates the same tokens through each")
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if (self.duration_s is not None and math.isinf(self.request_rate)
                and self.max_concurrency is None):
            raise BenchError("--duration with an infinite --request-rate needs --max-concurrency")
        for q in self.percentiles:
            if not 0 <= q <= 100:
                raise BenchError(f"--percentiles values must be in [0, 100], got {q}")
        if self.cost_per_hour is not None and not (self.cost_per_hour > 0 and math.isfinite(self.cost_per_hour)):
            raise BenchError(f"--cost-per-hour must be > 0, got {self.cost_per_hour}")
        try:
            AbortPlan(self.abort_fraction, self.abort_after, self.seed)
        except ValueError as e:
            raise BenchError(str(e)) from None
        if self.abort_after is not None and self.abort_fraction == 0:
            raise BenchError("--abort-after needs --abort-fraction > 0 (the share of requests abandoned)")

    @property
    def root_url(self) -> str:
        """Server root: ``base_url`` without a trailing ``/`` or ``/v1``."""
        u = self.base_url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u


# ---------------------------------------------------------------------------
# argparse types (argparse prefixes the flag to the message)
# ---------------------------------------------------------------------------


def positive_float(v: str) -> float:
    """Argparse type: a number > 0 (``inf`` allowed). Raises ``ArgumentTypeError``."""
    try:
        f = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {v!r}") from None
    if not f > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {v}")
    return f


def percentile_list(v: str) -> tuple:
    """Argparse type: comma-separated percentiles in [0, 100]. Raises ``ArgumentTypeError``."""
    try:
        qs = tuple(float(x) for x in v.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {v!r}") from None
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError(f"values must be in [0, 100], got {v!r}")
    return qs


def endpoint_types(v: str) -> tuple[str, ...]:
    """Argparse type of ``--endpoint-type``: ``auto``, or one or more comma-separated endpoint
    types (each run in turn by ``bench serve``). Raises ``ArgumentTypeError``."""
    kinds = tuple(x.strip() for x in v.split(",") if x.strip())
    bad = [k for k in kinds if k not in ("auto",) + ENDPOINT_TYPES]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(f"choose auto or from {', '.join(ENDPOINT_TYPES)} "
                                         f"(comma-separated), got {v!r}")
    if len(kinds) > 1 and "auto" in kinds:
        raise argparse.ArgumentTypeError("auto cannot be combined with other endpoint types")
    if len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"an endpoint type is repeated in {v!r}")
    return kinds


def json_object(v: str) -> dict:
    """Argparse type: a JSON object. Raises ``ArgumentTypeError``."""
    try:
        d = json.loads(v)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return d


# ---------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------


def add_common_arguments(p: Any, single_run: bool = True) -> None:
    """Server, dataset and load options shared by ``bench serve`` and ``bench sweep``
    (``single_run=False`` omits ``--request-rate`` and ``--max-concurrency``)."""
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    g.add_argument("--model", default=None, help="model name to request (default: first of /v1/models)")
    g.add_argument("--endpoint", default=None, help="override the request path, e.g. /v1/completions")
    g.add_argument("--endpoint-type", type=endpoint_types, default=("auto",),
                   metavar="{auto,completions,chat,responses,messages}",
                   help="the API: auto (completions for random/shared-prefix/trace, chat for "
                        "multi-turn/sharegpt), completions, chat, responses (/v1/responses) or messages "
                        "(Anthropic's /v1/messages); bench serve takes a comma-separated list, e.g. "
                        "chat,responses,messages, and runs the same workload through each in turn")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for building prompts: HF id/dir or .gguf (default: the bundled model's; "
                        "'none' = no tokenizer)")
    g.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default BASE_URL/metrics)")
    g.add_argument("--no-server-metrics", action="store_true", help="do not scrape /metrics")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    g.add_argument("--max-retries", type=int, default=0, help="retries per request on connection errors, "
                                                              "timeouts, 408/429/5xx before the first token")
    g.add_argument("--retry-backoff", type=float, default=0.25, help="first retry back-off in seconds (doubles)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM extension) so "
                                                             "outputs reach --output-len (completions and "
                                                             "chat only)")
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="completions prompts of random/shared-prefix/trace: token ids (exact lengths) or "
                        "decoded text (for servers that take only strings)")
    g.add_argument("--no-stream-usage", action="store_true",
                   help="do not send stream_options.include_usage (count tokens client-side); responses "
                        "and messages always stream their usage")
    g.add_argument("--extra-body", type=json_object, default={},
                   help="JSON object merged into each request body")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=("random", "shared-prefix", "multi-turn", "sharegpt", "trace"),
                   default="random")
    d.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON or trace file (trace default: the shipped synthetic agent trace)")
    d.add_argument("--input-len", type=int, default=256, help="prompt tokens (random; multi-turn first message)")
    d.add_argument("--output-len", type=int, default=128, help="max output tokens per request")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)], 0 <= r < 1")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: number of distinct prefixes")
    d.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    d.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: unique suffix tokens")
    d.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: requests per session")
    d.add_argument("--multi-turn-system-len", type=int, default=512,
                   help="multi-turn: shared system prompt tokens")
    d.add_argument("--multi-turn-tool-len", type=int, default=128, help="multi-turn: tool result tokens per turn")
    d.add_argument("--multi-turn-think-time", type=float, default=1.0,
                   help="multi-turn: seconds between a reply and the next turn")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: fixed output length (default: the reply's length)")
    d.add_argument("--sharegpt-max-prompt-len", type=int, default=1024)
    d.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    d.add_argument("--trace-format", choices=TRACE_FORMATS, default="auto",
                   help="trace: file format (auto: by extension and header; docs/traces.md)")
    d.add_argument("--trace-speedup", type=float, default=1.0,
                   help="trace: divide arrival times by this factor (2 = twice as fast)")
    d.add_argument("--trace-timestamp-unit", choices=("s", "ms"), default="s",
                   help="trace: unit of our JSONL's timestamps (Mooncake's are ms, CSVs' fixed)")
    d.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash_ids block")
    d.add_argument("--seed", type=int, default=0)

    ld = p.add_argument_group("load")
    if single_run:
        ld.add_argument("--request-rate", type=positive_float, default=math.inf,
                        help="mean arrivals per second (default inf: all at once)")
    ld.add_argument("--burstiness", type=positive_float, default=1.0,
                    help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 smoother")
    if single_run:
        ld.add_argument("--max-concurrency", type=positive_int, default=None, help="max sessions in flight")
    ld.add_argument("--num-prompts", type=positive_int, default=None,
                    help="sessions to send (requests for single-turn datasets; default 100, trace: all rows)")
    ld.add_argument("--duration", type=float, default=None, help="stop issuing new sessions after this many s")
    ld.add_argument("--num-warmups", type=int, default=0, help="warm-up requests, excluded from results")
    ld.add_argument("--percentiles", type=percentile_list, default=DEFAULT_PERCENTILES,
                    help="comma-separated percentiles to report (p90, p99 always included)")
    add_load_model_arguments(ld)
    ld.add_argument("--no-progress", action="store_true",
                    help="no live progress on stderr (a bar on a terminal, else a line every ~10 %%)")


def add_serve_arguments(p: Any) -> None:
    """Register ``bench serve`` flags on parser ``p``."""
    add_common_arguments(p, single_run=True)
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (metrics: ttft, tpot, itl, e2e)")
    o.add_argument("--save-result", default=None, metavar="FILE.json", help="write the full result as JSON")
    o.add_argument("--plot", default=None, metavar="DIR", help="write latency CDF and timeline PNGs to DIR")
    o.add_argument("--label", default=None, help="free-form label stored in the result")
    o.add_argument("--quiet", action="store_true", help="print only the final table")
    add_cost_arguments(p.add_argument_group("cost"), cost_per_hour=True)


# ---------------------------------------------------------------------------
# From flags to objects
# ---------------------------------------------------------------------------


def endpoint_kinds(args: Any) -> tuple[str, ...]:
    """The endpoint types ``--endpoint-type`` names, in order (a string is one)."""
    v = args.endpoint_type
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def config_from_args(args: Any, validate: bool = True) -> BenchConfig:
    """``BenchConfig`` from parsed args, its ``endpoint_type`` the first of
    ``--endpoint-type``'s; raises ``BenchError``/``ValueError`` naming the flag (each endpoint
    type of the list is validated)."""
    kinds = endpoint_kinds(args)
    cfg = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        endpoint_type=kinds[0],
        request_rate=getattr(args, "request_rate", math.inf),
        burstiness=args.burstiness,
        max_concurrency=getattr(args, "max_concurrency", None),
        num_prompts=args.num_prompts,
        duration_s=args.duration,
        num_warmups=args.num_warmups,
        timeout_s=args.timeout,
        max_retries=args.max_retries,
        retry_backoff_s=args.retry_backoff,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        stream_usage=not args.no_stream_usage,
        extra_body=dict(args.extra_body or {}),
        goodput_ms=parse_slos(getattr(args, "goodput", None), "--goodput"),
        percentiles=tuple(args.percentiles),
        metrics_url=args.metrics_url,
        scrape_metrics=not args.no_server_metrics,
        seed=args.seed,
        label=getattr(args, "label", None),
        quiet=getattr(args, "quiet", False),
        prompt_format=args.prompt_format,
        cost_per_hour=getattr(args, "cost_per_hour", None),
        api_price=getattr(args, "api_price", None),
        what_if_system_len=getattr(args, "what_if_system_len", None),
        abort_fraction=args.abort_fraction,
        abort_after=args.abort_after,
        progress=not (args.no_progress or getattr(args, "quiet", False)),
    )
    if validate:
        for kind in kinds:
            dataclasses.replace(cfg, endpoint_type=kind).validate()
    return cfg


def load_tokenizer(spec: str | None) -> Any | None:
    """The tokenizer for prompts: ``spec`` None = the bundled model's (None with a warning if
    it cannot load), ``"none"`` = no tokenizer, else a HF directory or ``.gguf`` file.
    Raises ``BenchError`` naming ``--tokenizer`` when an explicit spec cannot be loaded."""
    if spec is not None and spec.lower() == "none":
        return None
    from pagedllm.tokenizer import get_tokenizer

    try:
        return get_tokenizer(spec)
    except Exception as e:  # noqa: BLE001 - many loaders, many errors
        if spec is not None:
            raise BenchError(f"--tokenizer: cannot load {spec!r}: {e}") from None
        print(f"warning: no default tokenizer ({e}); prompt token counts are estimates",
              file=sys.stderr)
        return None


def build_dataset(args: Any, tokens: TokenSource) -> Dataset:
    """The dataset ``args.dataset`` names. Raises ``DatasetError`` naming the flag."""
    name = args.dataset
    if name == "random":
        return RandomDataset(tokens, args.input_len, args.output_len, args.random_range_ratio)
    if name == "shared-prefix":
        return SharedPrefixDataset(tokens, args.num_prefixes, args.prefix_len, args.suffix_len,
                                   args.output_len, args.random_range_ratio)
    if name == "multi-turn":
        return MultiTurnDataset(tokens, args.multi_turn_turns, args.multi_turn_system_len, args.input_len,
                                args.multi_turn_tool_len, args.output_len, args.multi_turn_think_time)
    if name == "sharegpt":
        return ShareGPTDataset(tokens, args.dataset_path, args.sharegpt_output_len,
                               args.sharegpt_max_prompt_len, args.sharegpt_max_total_len)
    if name == "trace":
        return TraceDataset(tokens, args.dataset_path, args.trace_speedup, args.trace_timestamp_unit,
                            args.trace_block_size, args.trace_format, args.num_prompts)
    raise DatasetError(f"--dataset: unknown dataset {name!r}")


def prepare(args: Any, tokenizer: Any = "load", validate: bool = True,
            several_endpoints: bool = False) -> tuple[BenchConfig, Dataset, TokenSource]:
    """Validate args and build (config, dataset, token source); ``tokenizer="load"`` loads
    ``args.tokenizer``, else the object given is used; ``several_endpoints``: a list of
    endpoint types is allowed (``bench serve``). Raises ``BenchError`` or ``DatasetError``
    naming the flag."""
    if not several_endpoints and len(endpoint_kinds(args)) > 1:
        raise BenchError("--endpoint-type: this command runs one endpoint type; a list (e.g. "
                         "chat,responses,messages) is for bench serve")
    cfg = config_from_args(args, validate)
    if args.dataset in ("sharegpt", "trace"):
        if not args.dataset_path and args.dataset == "sharegpt":
            raise DatasetError(f"--dataset {args.dataset} needs --dataset-path")
        if args.dataset_path and not os.path.isfile(args.dataset_path):
            raise DatasetError(f"--dataset-path: no such file: {args.dataset_path}")
    else:
        build_dataset(args, TokenSource(None))  # check the flags before a slow tokenizer load
    tok = load_tokenizer(args.tokenizer) if tokenizer == "load" else tokenizer
    tokens = TokenSource(tok, id_limit=DEFAULT_TOKENIZER_ID_LIMIT if args.tokenizer is None else None)
    dataset = build_dataset(args, tokens)
    if args.dataset == "multi-turn" and "completions" in endpoint_kinds(args):
        raise BenchError("--dataset multi-turn cannot use --endpoint-type completions")
    if dataset.timed and getattr(args, "request_rate", math.inf) != math.inf and not cfg.quiet:
        print("note: --dataset trace replays its own timestamps; --request-rate is ignored", file=sys.stderr)
    return cfg, dataset, tokens
