import itertools
import json

import numpy as np
import pytest

from pagedllm.benchmarks.datasets import (
    DatasetError,
    MultiTurnDataset,
    RandomDataset,
    ShareGPTDataset,
    SharedPrefixDataset,
    TokenSource,
    sample_lengths,
)
from pagedllm.benchmarks.traces import TraceDataset


def take(ds, n, seed=0):
    return list(itertools.islice(ds.sessions(seed), n))


def test_token_source_avoids_special_ids(word_tokenizer):
    ts = TokenSource(word_tokenizer)
    ids = ts.random_ids(5000, np.random.default_rng(0))
    assert len(ids) == 5000 and min(ids) >= 3 and max(ids) < 1000
    text, n = ts.text(20, np.random.default_rng(1))
    assert n == 20 and len(text.split()) == 20
    fallback = TokenSource(None)
    ids = fallback.random_ids(1000, np.random.default_rng(0))
    assert min(ids) >= 1000 and max(ids) < 20000
    assert not fallback.exact and fallback.count("a b c") == 3
    with pytest.raises(DatasetError, match="--tokenizer"):
        fallback.decode([5])


def test_random_exact_lengths_and_range(word_tokenizer):
    ds = RandomDataset(TokenSource(word_tokenizer), input_len=32, output_len=8)
    ss = take(ds, 20)
    assert all(len(s.turns) == 1 and s.kind == "completions" for s in ss)
    assert all(len(s.turns[0].prompt) == 32 and s.turns[0].prompt_len == 32 for s in ss)
    assert all(s.turns[0].output_len == 8 for s in ss)
    assert take(ds, 3, seed=5)[0].turns[0].prompt == take(ds, 3, seed=5)[0].turns[0].prompt
    assert take(ds, 1, seed=5)[0].turns[0].prompt != take(ds, 1, seed=6)[0].turns[0].prompt
    ds = RandomDataset(TokenSource(None), input_len=100, output_len=10, range_ratio=0.5)
    lens = [len(s.turns[0].prompt) for s in take(ds, 300)]
    outs = [s.turns[0].output_len for s in take(ds, 300)]
    assert min(lens) >= 50 and max(lens) <= 150 and max(lens) - min(lens) > 50
    assert min(outs) >= 5 and max(outs) <= 15
    lens = sample_lengths(10, 0.0, 50, np.random.default_rng(0), "--input-len")
    assert set(lens.tolist()) == {10}
    with pytest.raises(DatasetError, match="--random-range-ratio"):
        RandomDataset(TokenSource(None), 10, 10, range_ratio=1.0)
    with pytest.raises(DatasetError, match="--input-len"):
        RandomDataset(TokenSource(None), 0, 10)


def test_shared_prefix():
    ds = SharedPrefixDataset(TokenSource(None), num_prefixes=3, prefix_len=16, suffix_len=4, output_len=2)
    ss = take(ds, 60)
    prefixes = {tuple(s.turns[0].prompt[:16]) for s in ss}
    assert len(prefixes) == 3
    assert all(len(s.turns[0].prompt) == 20 for s in ss)
    assert len({tuple(s.turns[0].prompt[16:]) for s in ss}) > 50  # suffixes are fresh
    with pytest.raises(DatasetError, match="--num-prefixes"):
        SharedPrefixDataset(TokenSource(None), 0, 16, 4, 2)


def test_multi_turn_structure(word_tokenizer):
    ds = MultiTurnDataset(TokenSource(word_tokenizer), num_turns=3, system_len=12, input_len=6, tool_len=5,
                          output_len=4, think_time_s=0.25)
    s1, s2 = take(ds, 2)
    assert s1.kind == "chat" and len(s1.turns) == 3
    assert s1.system_prompt == s2.system_prompt and len(s1.system_prompt.split()) == 12
    assert [t.think_time_s for t in s1.turns] == [0.0, 0.25, 0.25]
    assert len(s1.turns[0].message.split()) == 6
    assert s1.turns[1].message.startswith("Tool result:") and s1.turns[1].prompt_len == 5
    with pytest.raises(DatasetError, match="--multi-turn-turns"):
        MultiTurnDataset(TokenSource(None), 0, 1, 1, 1, 1)
    with pytest.raises(DatasetError, match="--multi-turn-think-time"):
        MultiTurnDataset(TokenSource(None), 2, 1, 1, 1, 1, think_time_s=-1)


def test_sharegpt(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "one two three four five"},
                                       {"from": "gpt", "value": "r " * 7}]},
        {"id": "b", "conversations": [{"from": "human", "value": "too short"},
                                       {"from": "gpt", "value": "r " * 7}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "wrong order here ok"},
                                       {"from": "human", "value": "x y z w"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "w " * 10}]},
        {"id": "e", "conversations": [{"from": "user", "value": "alpha beta gamma delta"},
                                       {"from": "assistant", "value": "r " * 5}]},
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    ds = ShareGPTDataset(TokenSource(None), str(p))
    assert sorted((pl, ol) for _, pl, ol in ds.pairs) == [(4, 5), (5, 7)]
    ss = take(ds, 4)
    assert {s.turns[0].message for s in ss} == {"one two three four five", "alpha beta gamma delta"}
    assert ShareGPTDataset(TokenSource(None), str(p), output_len=9).pairs[0][2] == 9
    assert len(ShareGPTDataset(TokenSource(None), str(p), max_prompt_len=4).pairs) == 1
    with pytest.raises(DatasetError, match="--dataset-path"):
        ShareGPTDataset(TokenSource(None), str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DatasetError, match="--dataset-path"):
        ShareGPTDataset(TokenSource(None), str(bad))


def write_trace(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_trace_parsing_speedup_sessions(tmp_path):
    p = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 100.0, "prompt_len": 8, "output_len": 2, "session_id": "A"},
        {"timestamp": 100.4, "prompt": "hello there", "output_len": 3},
        {"timestamp": 101.0, "prompt_len": 12, "output_len": 2, "session_id": "A"},
        {"timestamp": 100.2, "input_length": 5, "output_length": 1},
    ])
    ds = TraceDataset(TokenSource(None), p, speedup=2.0)
    ss = take(ds, 10)
    assert [s.arrival_s for s in ss] == pytest.approx([0.0, 0.1, 0.2, 0.5])
    a1, other, text, a2 = ss
    assert a1.session_id == a2.session_id == "A"
    assert len(a1.turns[0].prompt) == 8 and len(a2.turns[0].prompt) == 12
    assert a2.turns[0].prompt[:8] == a1.turns[0].prompt  # same session -> growing prefix
    assert text.turns[0].prompt == "hello there" and text.turns[0].output_len == 3
    assert len(other.turns[0].prompt) == 5
    assert ds.describe()["span_s"] == pytest.approx(0.5)


def test_trace_hash_ids_and_ms(tmp_path):
    p = write_trace(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 8, "output_length": 1, "hash_ids": [1, 2, 9]},
    ])
    ds = TraceDataset(TokenSource(None), p, timestamp_unit="ms", block_size=4)
    s1, s2 = take(ds, 2)
    assert s2.arrival_s == pytest.approx(0.5)
    assert len(s1.turns[0].prompt) == 10 and len(s2.turns[0].prompt) == 8
    assert s1.turns[0].prompt[:8] == s2.turns[0].prompt[:8]


@pytest.mark.parametrize("row,msg", [
    ({"prompt_len": 3, "output_len": 1}, "timestamp"),
    ({"timestamp": 0, "output_len": 1}, "prompt"),
    ({"timestamp": 0, "prompt_len": 3, "output_len": 0}, "output_len"),
    ({"timestamp": "x", "prompt_len": 3, "output_len": 1}, "timestamp"),
])
def test_trace_errors_name_line(tmp_path, row, msg):
    p = write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0, "prompt_len": 1, "output_len": 1}, row])
    with pytest.raises(DatasetError, match=msg) as ei:
        TraceDataset(TokenSource(None), p)
    assert "line 2" in str(ei.value)


def test_trace_bad_options(tmp_path):
    p = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "prompt_len": 1, "output_len": 1}])
    with pytest.raises(DatasetError, match="--trace-speedup"):
        TraceDataset(TokenSource(None), p, speedup=0)
    with pytest.raises(DatasetError, match="--dataset-path"):
        TraceDataset(TokenSource(None), str(tmp_path / "nope.jsonl"))


def test_token_source_id_limit(word_tokenizer):
    ids = TokenSource(word_tokenizer, id_limit=500).random_ids(2000, np.random.default_rng(0))
    assert min(ids) >= 3 and max(ids) < 500
