import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_server import FakeServer, LatencyModel  # noqa: E402


class WordTokenizer:
    """Tiny HF-like tokenizer: words ``w0``..``w999`` map to ids 0..999 (0-2 special)."""

    all_special_ids = [0, 1, 2]

    def __len__(self) -> int:
        return 1000

    def encode(self, text, add_special_tokens=False):
        out = []
        for w in text.split():
            if w.startswith("w") and w[1:].isdigit() and int(w[1:]) < 1000:
                out.append(int(w[1:]))
            else:
                out.append(3 + (sum(map(ord, w)) % 997))
        return out

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i in self.all_special_ids))


@pytest.fixture
def word_tokenizer():
    return WordTokenizer()


@pytest.fixture
def fake_server():
    """Factory: ``fake_server(**LatencyModel fields)`` -> started FakeServer (stopped at teardown)."""
    servers = []

    def make(**kw):
        srv = FakeServer(LatencyModel(**kw)).__enter__()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.__exit__(None, None, None)


def run_cli(argv, tokenizer=None):
    """Parse ``argv`` with the standalone parser and run it with an injected tokenizer.

    Returns the exit code. ``tokenizer=None`` means no tokenizer (fallback ids).
    """
    from pagedllm.benchmarks.cli import build_parser
    from pagedllm.benchmarks.profile_summary import summarize_main
    from pagedllm.benchmarks.serve import serve_main
    from pagedllm.benchmarks.sweep import sweep_main

    args = build_parser().parse_args(argv)
    if args.command == "profile":
        return summarize_main(args)
    fn = serve_main if args.bench_command == "serve" else sweep_main
    return fn(args, tokenizer=tokenizer)
