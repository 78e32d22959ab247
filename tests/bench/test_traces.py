"""Trace replay (``--dataset trace``): each format's reader on a small recorded sample of it,
arrival times and ``--trace-speedup``, Mooncake block reuse as exact shared prefixes, bad
rows named, and the shipped agent trace with its generator."""

import hashlib
import json
import os

import numpy as np
import pytest
from bench_helpers import run_cli

from pagedllm.benchmarks import agent_trace
from pagedllm.benchmarks.datasets import DatasetError, TokenSource
from pagedllm.benchmarks.traces import AGENT_TRACE_PATH, TraceDataset, TraceTurn, detect_format, parse_azure_time

MOONCAKE = [  # Mooncake's fields; timestamps in ms; each hash id a 512-token block
    {"timestamp": 0, "input_length": 1300, "output_length": 12, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 7]},
    {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 5]},
    {"timestamp": 3000, "input_length": 400, "output_length": 3, "hash_ids": [9]},
]
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.3950000,879,0
2023-11-16 18:16:00.1805900,1055,13
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
160,ChatGPT,36,9,45,Conversation log
"""


def write(path, text):
    path.write_text(text)
    return str(path)


def write_jsonl(path, rows):
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def sessions(ds, seed=0):
    return list(ds.sessions(seed))


@pytest.mark.parametrize("exact_text", [False, True])
def test_mooncake_hash_ids_become_identical_prefixes(tmp_path, request, exact_text):
    tokens = TokenSource(request.getfixturevalue("tokenizer") if exact_text else None)
    p = write_jsonl(tmp_path / "mooncake_trace.jsonl", MOONCAKE)
    assert detect_format(p) == "mooncake"
    ds = TraceDataset(tokens, p)
    a, b, c, d = (s.turns[0] for s in sessions(ds))
    assert [s.arrival_s for s in sessions(ds)] == pytest.approx([0.0, 1.5, 3.0, 3.0])
    assert [len(t.prompt) for t in (a, b, c, d)] == [1300, 1100, 600, 400]
    assert [t.prompt_len for t in (a, b, c, d)] == [1300, 1100, 600, 400]
    assert [t.output_len for t in (a, b, c, d)] == [12, 7, 5, 3]
    assert a.prompt[:1024] == b.prompt[:1024] and a.prompt[1024:1100] != b.prompt[1024:1100]  # [0, 1] shared
    assert c.prompt[:512] == a.prompt[:512] and c.prompt[512:600] != a.prompt[512:600]        # [0] shared
    assert d.prompt[:400] != a.prompt[:400]
    if exact_text:  # as text (--prompt-format text, chat) the shared prefixes are 512*k tokens exactly
        for t, k in ((b, 2), (c, 1)):
            shared = tokens.decode(t.prompt[:512 * k])
            assert shared == tokens.decode(a.prompt[:512 * k]) and tokens.count(shared) == 512 * k
        assert [tokens.count(tokens.decode(t.prompt)) for t in (a, b, c, d)] == [1300, 1100, 600, 400]
    # a block's content depends on its id alone, wherever and whenever it appears
    q = write_jsonl(tmp_path / "other.jsonl", [{"timestamp": 0, "input_length": 1024, "output_length": 1,
                                                "hash_ids": [4, 1]}])
    (other,) = sessions(TraceDataset(tokens, q))
    assert other.turns[0].prompt[512:] == a.prompt[512:1024]
    assert sessions(ds, seed=1)[0].turns[0].prompt != a.prompt  # the seed picks the words


def test_azure_csv_lengths_arrivals_and_speedup(tmp_path):
    p = write(tmp_path / "AzureLLMInferenceTrace_conv.csv", AZURE)
    assert detect_format(p) == "azure"
    ds = TraceDataset(TokenSource(None), p)
    ss = sessions(ds)
    assert [s.arrival_s for s in ss] == pytest.approx([0.0, 4.314579, 13.5])
    assert [(s.turns[0].prompt_len, len(s.turns[0].prompt), s.turns[0].output_len) for s in ss] == \
        [(374, 374, 44), (396, 396, 109), (1055, 1055, 13)]
    assert ds.kind == "completions" and ds.describe()["skipped_rows"] == 1 and ds.describe()["format"] == "azure"
    fast = sessions(TraceDataset(TokenSource(None), p, speedup=2.0))
    assert [s.arrival_s for s in fast] == pytest.approx([0.0, 4.314579 / 2, 13.5 / 2])
    assert parse_azure_time("2024-05-10 00:00:01.5+00:00") - parse_azure_time("2024-05-10 02:00:00+02:00") == 1.5


def test_burstgpt_csv_skips_failed_rows(tmp_path):
    p = write(tmp_path / "BurstGPT_1.csv", BURSTGPT)
    assert detect_format(p) == "burstgpt"
    ds = TraceDataset(TokenSource(None), p, trace_format="burstgpt")
    ss = sessions(ds)
    assert [s.arrival_s for s in ss] == pytest.approx([0.0, 113.0, 155.0])  # the 0-response row is gone
    assert [(s.turns[0].prompt_len, s.turns[0].output_len) for s in ss] == [(472, 18), (417, 276), (36, 9)]
    assert ds.describe()["skipped_rows"] == 1 and ds.describe()["num_rows"] == 3
    assert [s.arrival_s for s in sessions(TraceDataset(TokenSource(None), p, speedup=2.0))] == \
        pytest.approx([0.0, 56.5, 77.5])
    # a cap takes the first N requests of the file
    assert [s.turns[0].prompt_len for s in sessions(TraceDataset(TokenSource(None), p, limit=2))] == [472, 417]


def test_our_jsonl_chat_sessions(tmp_path, tokenizer):
    rows = [
        {"session_id": "b", "turn": 0, "timestamp": 12.0, "user_id": "u1", "system_prompt_len": 40,
         "instruction_len": 9, "message_id": 1, "message_len": 20, "output_len": 8},
        {"session_id": "a", "turn": 0, "timestamp": 10.0, "user_id": "u2", "system_prompt_len": 40,
         "instruction_len": 5, "message_id": 2, "message_len": 30, "output_len": 4},
        {"session_id": "a", "turn": 1, "think_time_s": 0.7, "role": "tool", "message_len": 300, "output_len": 6,
         "abort_after_tokens": 2},
        {"session_id": "a", "turn": 2, "think_time_s": 2.5, "message_id": 2, "message_len": 30, "output_len": 4,
         "reask_of": 0},
    ]
    tokens = TokenSource(tokenizer)
    ds = TraceDataset(tokens, write_jsonl(tmp_path / "chat.jsonl", rows), speedup=4.0)
    a, b = sessions(ds)
    assert ds.kind == "chat" and (a.session_id, b.session_id) == ("a", "b") and b.arrival_s == pytest.approx(0.5)
    assert a.kind == "chat" and tokens.count(a.system_prompt) == 45 and tokens.count(b.system_prompt) == 49
    assert a.system_prompt.split()[:40] == b.system_prompt.split()[:40]  # one shared system prompt
    assert all(isinstance(t, TraceTurn) for t in a.turns)
    assert [(t.role, t.prompt_len, tokens.count(t.message), t.think_time_s, t.abort_after_tokens, t.output_len)
            for t in a.turns] == [("user", 30, 30, 0.0, None, 4), ("tool", 300, 300, 0.7, 2, 6),
                                  ("user", 30, 30, 2.5, None, 4)]   # think times are not sped up
    assert a.turns[2].message == a.turns[0].message  # the re-asked question


@pytest.mark.parametrize("name,text,msg,line", [
    ("m.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n'
                '{"timestamp": 5, "output_length": 1, "hash_ids": [2]}\n', "input_length", 2),
    ("m.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n{oops\n',
     "invalid JSON", 2),
    ("a.csv", AZURE.replace("18:15:50.9951690", "yesterday"), "TIMESTAMP", 3),
    ("b.csv", BURSTGPT.replace("118,GPT-4,417", "118,GPT-4,many"), "Request tokens", 4),
    ("b.csv", BURSTGPT.replace("5,ChatGPT,472,18,490,Conversation log", "5,ChatGPT"), "columns", 2),
    ("c.jsonl", '{"session_id": "s", "turn": 0, "timestamp": 0, "message_len": 3, "output_len": 1}\n'
                '{"session_id": "s", "turn": 2, "message_len": 3, "output_len": 1}\n', "turn 1", 2),
    ("c.jsonl", '{"session_id": "s", "turn": 0, "timestamp": 0, "message_len": 3, "output_len": 1}\n'
                '{"timestamp": 1, "prompt_len": 3, "output_len": 1}\n', "mixed", 2),
    ("c.jsonl", '{"session_id": "s", "turn": 0, "timestamp": 0, "message_len": 3, "output_len": 1, '
                '"role": "bot"}\n', "role", 1),
])
def test_bad_rows_are_named(tmp_path, name, text, msg, line):
    p = write(tmp_path / name, text)
    with pytest.raises(DatasetError, match=msg) as ei:
        TraceDataset(TokenSource(None), p)
    assert f"--dataset-path {p}, line {line}" in str(ei.value)


def test_format_errors_name_the_flag(tmp_path):
    p = write(tmp_path / "x.csv", "when,in,out\n1,2,3\n")
    with pytest.raises(DatasetError, match="--trace-format"):
        TraceDataset(TokenSource(None), p)
    with pytest.raises(DatasetError, match="line 1.*ContextTokens"):
        TraceDataset(TokenSource(None), p, trace_format="azure")
    with pytest.raises(DatasetError, match="--trace-format must be one of"):
        TraceDataset(TokenSource(None), p, trace_format="sharegpt")


# ---------------------------------------------------------------------------
# The shipped agent trace and its generator
# ---------------------------------------------------------------------------


def _records(path):
    with open(path) as f:
        lines = f.read().splitlines()
    return json.loads(lines[0][2:]), [json.loads(x) for x in lines[1:]]


def _chain(words, block):
    out, h = [], b""
    for i in range(len(words) // block):
        h = hashlib.sha1(h + " ".join(words[i * block:(i + 1) * block]).encode()).digest()
        out.append(h)
    return out


def _block_cache_share(ds, block=16):
    """Share of prompt tokens a prefix cache of ``block``-token blocks (chained hashes, as the
    engine's) would serve replaying ``ds``, each reply as long as the trace says, computed
    from the prompt text itself (a word is a token without a tokenizer)."""
    cached, served, total = set(), 0, 0
    for s in ds.sessions(0):
        conv = s.system_prompt.split()
        for k, t in enumerate(s.turns):
            conv = conv + t.message.split()
            hashes = _chain(conv, block)
            served += block * next((i for i, x in enumerate(hashes) if x not in cached), len(hashes))
            total += len(conv)
            conv = conv + [f"<{s.session_id}.{k}.{j}>" for j in range(t.abort_after_tokens or t.output_len)]
            cached.update(_chain(conv, block))
    return served / total


def test_shipped_agent_trace_loads_with_its_reuse():
    assert os.path.getsize(AGENT_TRACE_PATH) < 100_000
    head, recs = _records(AGENT_TRACE_PATH)
    target = head["params"]["reuse"]
    assert target == 0.86
    ds = TraceDataset(TokenSource(None))  # no --dataset-path: the shipped trace
    ss = sessions(ds)
    assert ds.path == AGENT_TRACE_PATH and ds.kind == "chat" and len(ss) == head["params"]["sessions"] == 40
    assert sum(len(s.turns) for s in ss) == len(recs) == ds.describe()["num_rows"]
    turns = [t for s in ss for t in s.turns]
    assert all(len(t.message.split()) == t.prompt_len for t in turns)  # exact lengths
    assert {t.role for t in turns} == {"user", "tool"}
    assert any(t.abort_after_tokens for t in turns) and any("reask_of" in r for r in recs)
    assert all(t.think_time_s > 0 for s in ss for t in s.turns[1:])
    assert len({tuple(s.system_prompt.split()[:3000]) for s in ss}) == 1  # one shared system prompt
    served, total = agent_trace.prefix_reuse(recs)
    assert served / total == pytest.approx(target, abs=0.002)
    # the same share measured independently, on the text, with a block-granular cache
    assert _block_cache_share(ds) == pytest.approx(target, abs=0.02)


def test_shipped_trace_is_the_generators_default_output(tmp_path):
    out = tmp_path / "t.jsonl"
    assert agent_trace.main(["--out", str(out)]) == 0
    with open(AGENT_TRACE_PATH, "rb") as f:
        assert out.read_bytes() == f.read()


def test_generator_is_deterministic_and_hits_its_reuse(tmp_path, capsys):
    args = ["--sessions", "12", "--system-len", "500", "--instruction-len", "20,80", "--turns", "2,5",
            "--message-len", "10,60", "--tool-len", "50,300", "--max-context", "4000"]
    a, b, c = (tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    assert agent_trace.main(args + ["--seed", "3", "--reuse", "0.7", "--out", str(a)]) == 0
    assert agent_trace.main(args + ["--seed", "3", "--reuse", "0.7", "--out", str(b)]) == 0
    assert agent_trace.main(args + ["--seed", "4", "--reuse", "0.7", "--out", str(c)]) == 0
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert "prefix reuse 0.70" in capsys.readouterr().out
    served, total = agent_trace.prefix_reuse(_records(a)[1])
    assert served / total == pytest.approx(0.7, abs=0.01)
    assert agent_trace.main(args + ["--reuse", "0.999", "--out", str(c)]) == 2
    assert "--reuse 0.999 is out of reach" in capsys.readouterr().err


def test_prefix_reuse_by_hand():
    recs = [  # system 100 + instruction 10; replies 5 (the second abandoned after 2)
        {"session_id": "x", "turn": 0, "timestamp": 0, "user_id": "u", "system_prompt_len": 100,
         "instruction_len": 10, "message_id": 1, "message_len": 20, "output_len": 5},
        {"session_id": "x", "turn": 1, "message_id": 2, "message_len": 30, "output_len": 5, "abort_after_tokens": 2},
        {"session_id": "x", "turn": 2, "message_id": 3, "message_len": 7, "output_len": 5},
        {"session_id": "y", "turn": 0, "timestamp": 1, "user_id": "v", "system_prompt_len": 100,
         "instruction_len": 10, "message_id": 1, "message_len": 20, "output_len": 5},
    ]
    # prompts: 130, 130+5+30=165, 165+2+7=174, 130; served: 0, 135, 167, 100 (other user's instruction)
    assert agent_trace.prefix_reuse(recs) == (0 + 135 + 167 + 100, 130 + 165 + 174 + 130)


def test_bench_serve_replays_a_chat_trace(fake_server, tmp_path):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    rows = [{"session_id": f"s{i}", "turn": 0, "timestamp": i * 0.02, "system_prompt_len": 12,
             "message_len": 5, "output_len": 3} for i in range(2)]
    rows += [{"session_id": f"s{i}", "turn": 1, "think_time_s": 0.01, "role": "tool", "message_len": 9,
              "output_len": 2} for i in range(2)]
    p = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "r.json"
    assert run_cli(["bench", "serve", "--base-url", srv.url, "--quiet", "--dataset", "trace", "--dataset-path", p,
                    "--save-result", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 4 and res["dataset"]["format"] == "pagedllm"
    bodies = [r["body"] for r in srv.stats.requests]
    assert all(r["chat"] for r in srv.stats.requests)
    second = [b["messages"] for b in bodies if len(b["messages"]) == 4]
    assert len(second) == 2 and [m["role"] for m in second[0]] == ["system", "user", "assistant", "user"]
    assert len(second[0][3]["content"].split()) == 9 and len(second[0][0]["content"].split()) == 12


def test_dataset_trace_without_path_is_the_agent_trace():
    from pagedllm.benchmarks.serve_options import prepare
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--dataset", "trace", "--num-prompts", "3",
                                      "--trace-speedup", "2"])
    _, ds, _ = prepare(args, tokenizer=None)
    assert ds.path == AGENT_TRACE_PATH and len(ds.groups) == 3 and ds.speedup == 2.0
    first = [s.arrival_s for s in sessions(TraceDataset(TokenSource(None)))][:3]
    assert [s.arrival_s for s in sessions(ds)] == pytest.approx([t / 2 for t in first])
