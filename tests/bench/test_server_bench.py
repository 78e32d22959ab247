"""``pagedllm bench server``'s pieces that need no server: the engine flags it passes to
``pagedllm serve`` reproduce the EngineArgs they came from, and the offline run's prompts
are the ones ``bench serve``'s random dataset sends."""
from __future__ import annotations

import argparse
import itertools

from pagedllm.benchmarks.server import _prompts, _serve_args, engine_cli_args
from pagedllm.config import EngineArgs


def test_engine_flags_round_trip():
    ea = EngineArgs(dtype="bfloat16", max_model_len=512, kv_cache_memory="1GiB", enable_prefix_caching=False,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3}, num_threads=2)
    flags = engine_cli_args(ea)
    assert "--no-enable-prefix-caching" in flags and "--engine-process" not in flags
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    back = EngineArgs.from_cli_args(p.parse_args(flags))
    assert back.dtype == "bfloat16" and back.max_model_len == 512 and back.kv_cache_memory == "1GiB"
    assert back.enable_prefix_caching is False and back.num_threads == 2
    assert back.speculative_config == '{"method": "ngram", "num_speculative_tokens": 3}'
    assert engine_cli_args(EngineArgs()) == []


class _Tok:
    """A tokenizer stand-in: random-id prompts need only the vocabulary size."""

    vocab_size = 1000

    def __len__(self):
        return 1000

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_offline_prompts_are_the_served_ones():
    from pagedllm.benchmarks.serve_options import prepare

    args = argparse.Namespace(input_len=20, output_len=4)
    got = _prompts(args, 5, _Tok())
    cfg, dataset, _ = prepare(_serve_args("http://x", args, 5, 5), _Tok(), validate=False)
    want = [s.turns[0].prompt for s in itertools.islice(dataset.sessions(cfg.seed), 5)]
    assert got == want and len(got) == 5 and all(len(p) == 20 for p in got)
    assert len({tuple(p) for p in got}) == 5
