"""The ``pagedllm`` command: serve, generate, models, bench, profile.

A *command module* has ``register(subparsers)``, which adds its parser(s) and sets
``func`` (parsed ``Namespace`` -> exit code; ``ValueError`` / ``FileNotFoundError`` exit
2). :data:`COMMANDS` lists the modules per parent command, in ``--help`` order; a new
``pagedllm bench X`` is a module registering ``X`` plus its name in ``COMMANDS["bench"]``.
This module registers ``serve`` and ``generate``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pagedllm import envs

# --tool-call-parser's and --reasoning-parser's choices (their packages are pure: they
# import nothing heavy)
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS as _REASONING
from pagedllm.entrypoints.openai.tool_calls import TOOL_PARSERS as _PARSERS

TOOL_PARSER_NAMES = tuple(_PARSERS)
REASONING_PARSER_NAMES = tuple(_REASONING)

#: Parent command -> (its help, the command modules registered under it).
#: The parent "" is ``pagedllm`` itself.
COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "": ("LLM inference and serving engine", ("pagedllm.entrypoints.cli",)),
    "bench": ("benchmarks", ("pagedllm.benchmarks.throughput", "pagedllm.benchmarks.prefix",
                             "pagedllm.benchmarks.serve", "pagedllm.benchmarks.sweep",
                             "pagedllm.benchmarks.host_overhead", "pagedllm.benchmarks.latency",
                             "pagedllm.benchmarks.accuracy", "pagedllm.benchmarks.attention",
                             "pagedllm.benchmarks.spec", "pagedllm.benchmarks.sampling",
                             "pagedllm.benchmarks.server", "pagedllm.benchmarks.kv_blocks",
                             "pagedllm.benchmarks.roofline")),
    "profile": ("inspect --profile-dir output", ("pagedllm.benchmarks.profile_summary",)),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or its help already says it."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if action.default is None or "default" in help_text or action.default is argparse.SUPPRESS:
            return help_text
        return super()._get_help_string(action)


def _log_level_arg(value: str) -> str:
    """``--log-level``'s type: one of ``envs.LOG_LEVELS`` in any case, upper-cased."""
    try:
        return envs.check_log_level(value, "--log-level")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--log-level ")) from None


def _setup_logging(level: str = "INFO") -> None:
    """``level``: one of ``envs.LOG_LEVELS`` (checked by the parser)."""
    logging.basicConfig(level=getattr(logging, level),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _models(args) -> int:
    """``pagedllm models``: the supported architectures and what each supports."""
    import json

    from pagedllm.models.registry import describe_architectures

    rows = describe_architectures()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ["architecture", "gguf", "models", "sliding_window", "moe", "quantization", "dtypes"]
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(width[c]) for c in cols))
    return 0


def _serve(args) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    if args.model_tag is not None:   # vllm serve MODEL
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.headless:
        return _headless(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:   # before the model loads
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty (leave it out to serve without auth)")
    if not 0 <= args.shutdown_timeout < float("inf"):   # nan and inf too
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0-65535, got {args.port}")
    run_server(args)
    return 0


def _headless(args) -> int:
    """``serve --headless``: this node's tensor-parallel ranks, no API server."""
    from pagedllm.config import EngineArgs, EngineConfig
    from pagedllm.executor.multiproc_executor import run_headless

    return run_headless(EngineConfig.from_args(EngineArgs.from_cli_args(args)))


# generate's sampling flags by SamplingParams field, to name the flag in errors
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                   "seed": "--seed-sampling"}


def _generate(args) -> int:
    import pagedllm
    from pagedllm.config import EngineArgs
    from pagedllm.errors import InvalidParameterError

    # Check the sampling flags before the model is loaded (seconds to minutes).
    try:
        sp = pagedllm.SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                     seed=args.seed_sampling, max_tokens=args.max_tokens)
    except InvalidParameterError as e:
        raise ValueError(f"{_SAMPLING_FLAGS.get(e.param, e.param)}: {e}") from e
    if not args.prompt:
        raise ValueError("PROMPT must not be empty")
    ea = EngineArgs.from_cli_args(args)
    ea.validate()
    # Settings that need the model's config (max_model_len vs its context, the device)
    # are checked by LLM before it reads the tokenizer or any weight.
    kwargs = {k: v for k, v in vars(ea).items() if k != "model"}
    llm = pagedllm.LLM(model=ea.model, **kwargs)
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], sp, use_tqdm=False)[0]
        else:
            out = llm.generate(args.prompt, sp, use_tqdm=False)[0]
    finally:
        llm.shutdown()   # ends a --profile-dir trace and writes it
    print(out.outputs[0].text)
    return 0


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add ``serve`` and ``generate`` to ``pagedllm``'s sub-parsers."""
    from pagedllm.config import EngineArgs

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              formatter_class=HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (as in `vllm serve MODEL`)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--uvicorn-log-level", default="warning", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="honour a chat request's own chat_template field (a template is a program "
                        "the server runs; off by default, as in vLLM)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" read tool calls from the output (needs --tool-call-parser)')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSER_NAMES),
                   help="the format of the model's tool calls, for tool_choice \"auto\"")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSER_NAMES),
                   help="split the model's <think> block from its answer (chat: reasoning_content)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health "
                        "(default: $PAGEDLLM_API_KEY; none: no auth)")
    p.add_argument("--metrics-without-auth", action="store_true",
                   help="serve /metrics without the API key (for a Prometheus scraper)")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 with Retry-After to a new request while this many wait for the "
                        "engine (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, seconds that in-flight requests get to finish before "
                        "they are aborted")
    p.add_argument("--headless", action="store_true",
                   help="run this node's tensor-parallel ranks only (a node other than 0 of --nnodes; "
                        "no API server)")
    p.set_defaults(func=_serve)

    p = subparsers.add_parser("generate", help="print a completion of PROMPT",
                              formatter_class=HelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_generate)

    p = subparsers.add_parser("models", help="list the supported model architectures and what each supports")
    p.add_argument("--json", action="store_true", help="one JSON object per architecture")
    p.set_defaults(func=_models)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedllm`` parser: every module of :data:`COMMANDS` under its parent; a parent
    ``X`` puts its sub-command in ``args.X_command``, the top-level one in ``args.command``."""
    parser = argparse.ArgumentParser(prog="pagedllm", description=COMMANDS[""][0])
    parser.add_argument("--log-level", type=_log_level_arg, default=None,
                        help="critical, error, warning, info or debug (default: $PAGEDLLM_LOG_LEVEL or info)")
    sub = parser.add_subparsers(dest="command", required=True)
    for parent, (help_text, modules) in COMMANDS.items():
        target = sub if not parent else sub.add_parser(parent, help=help_text).add_subparsers(
            dest=f"{parent}_command", required=True)
        for name in modules:
            importlib.import_module(name).register(target)
    return parser


# Flags whose value is itself a string of flags (``bench throughput --compare-args``):
# argparse takes "--compare-args -q int8" for a flag without its value, so the word after
# such a flag is attached to it ("--compare-args=-q int8") before parsing.
_FLAGS_OF_FLAGS = ("--compare-args",)


def _attach_flag_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _FLAGS_OF_FLAGS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_flag_values(sys.argv[1:] if argv is None else list(argv)))
    if args.log_level is None:
        try:
            args.log_level = envs.log_level()
        except ValueError as e:
            parser.error(str(e))
    _setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        from pagedllm.config import EngineArgs

        print(f"error: {EngineArgs.cli_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
