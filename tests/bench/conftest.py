import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from bench_helpers import WordTokenizer  # noqa: E402
from fake_server import FakeServer, LatencyModel  # noqa: E402


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

