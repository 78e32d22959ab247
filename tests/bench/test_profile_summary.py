import json

import msgspec
import pytest
from bench_helpers import run_cli

from pagedllm.benchmarks.profile_summary import (
    ProfileError,
    load_steps,
    split_runs,
    summarize_profile_dir,
    summarize_steps,
)
from pagedllm.core.step_profiler import StepProfiler, StepRecord


def step(i, st, sch, ex, up, pre, dec, reqs, used, pre_empt=0, waiting=0):
    return StepRecord(step=i, ts=1000.0 + i, step_time_s=st, schedule_time_s=sch, execute_time_s=ex,
                      update_time_s=up, num_prefill_tokens=pre, num_decode_tokens=dec, num_reqs=reqs,
                      num_running=reqs, num_waiting=waiting, kv_blocks_used=used, kv_blocks_total=100,
                      num_preemptions=pre_empt)


STEPS = [
    step(0, 0.100, 0.010, 0.080, 0.005, 100, 0, 2, 10, waiting=3),
    step(1, 0.020, 0.002, 0.016, 0.001, 0, 2, 2, 12),
    step(2, 0.060, 0.006, 0.050, 0.002, 50, 1, 2, 40, pre_empt=1),
    step(3, 0.020, 0.002, 0.016, 0.001, 0, 2, 2, 15, pre_empt=1),
    step(4, 0.000, 0.000, 0.000, 0.000, 0, 0, 0, 0),
]


def write_dir(tmp_path, steps=STEPS, trace=True):
    d = tmp_path / "prof"
    d.mkdir()
    (d / "steps.jsonl").write_bytes(b"".join(msgspec.json.encode(s) + b"\n" for s in steps))
    if trace:
        ev = [
            {"ph": "X", "name": "A", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
            {"ph": "X", "name": "B", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 10, "dur": 30},
            {"ph": "X", "name": "C", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 15, "dur": 10},
            {"ph": "X", "name": "D", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 50, "dur": 20},
            {"ph": "X", "name": "A", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 200, "dur": 50},
            {"ph": "X", "name": "K", "cat": "kernel", "pid": 1, "tid": 7, "ts": 20, "dur": 40},
            {"ph": "i", "name": "marker", "pid": 1, "tid": 1, "ts": 5},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
        ]
        (d / "trace.json").write_text(json.dumps({"traceEvents": ev}))
    return d


def test_summarize_steps_known_values():
    s = summarize_steps(STEPS)
    total = 0.2
    assert s["num_steps"] == 5
    assert s["total_step_time_s"] == pytest.approx(total)
    assert s["step_time_ms"]["mean"] == pytest.approx(40.0)
    assert s["step_time_ms"]["p50"] == pytest.approx(20.0)
    assert s["step_time_ms"]["max"] == pytest.approx(100.0)
    assert s["step_time_ms"]["p99"] == pytest.approx(60 + 0.96 * 40)  # numpy linear interpolation
    assert s["time_share"]["schedule"] == pytest.approx(0.020 / total)
    assert s["time_share"]["execute"] == pytest.approx(0.162 / total)
    assert s["time_share"]["update"] == pytest.approx(0.009 / total)
    assert s["time_share"]["other"] == pytest.approx(0.009 / total)
    assert s["tokens"]["prefill"] == 150 and s["tokens"]["decode"] == 5
    assert s["tokens"]["prefill_share"] == pytest.approx(150 / 155)
    sp = s["split"]
    assert sp["prefill_steps"]["steps"] == 2 and sp["prefill_steps"]["time_s"] == pytest.approx(0.16)
    assert sp["prefill_steps"]["time_share"] == pytest.approx(0.8)
    assert sp["decode_only_steps"]["steps"] == 2 and sp["decode_only_steps"]["mean_step_ms"] == pytest.approx(20.0)
    assert sp["idle_steps"]["steps"] == 1
    assert s["batch"]["mean_num_reqs"] == pytest.approx(2.0) and s["batch"]["max_waiting"] == 3
    assert s["kv_cache"]["peak_blocks_used"] == 40 and s["kv_cache"]["peak_usage"] == pytest.approx(0.4)
    assert s["preemptions"] == 2
    assert s["wall_span_s"] == pytest.approx(4.1)
    assert summarize_steps([]) == {"num_steps": 0}


def test_trace_self_time(tmp_path):
    d = write_dir(tmp_path)
    tr = summarize_profile_dir(str(d))["trace"]
    assert tr["num_events"] == 6
    ops = {o["name"]: o for o in tr["top_ops"]}
    assert ops["A"]["count"] == 2
    assert ops["A"]["self_ms"] == pytest.approx(0.100)   # (100 - 30 - 20) + 50 us
    assert ops["A"]["total_ms"] == pytest.approx(0.150)
    assert ops["B"]["self_ms"] == pytest.approx(0.020)
    assert ops["C"]["self_ms"] == pytest.approx(0.010)
    assert ops["K"]["self_ms"] == pytest.approx(0.040)  # other track: not a child of A
    assert ops["A"]["self_share"] == pytest.approx(100 / 150)
    assert ops["K"]["self_share"] == pytest.approx(1.0)
    assert tr["top_ops"][0]["name"] == "A"
    assert tr["by_category"] == pytest.approx({"cpu_op": 0.15, "kernel": 0.04})


def test_cli_summarize(tmp_path, capsys):
    d = write_dir(tmp_path)
    assert run_cli(["profile", "summarize", str(d)]) == 0
    out = capsys.readouterr().out
    for text in ("Steps: 5", "schedule 10.0%", "execute 81.0%", "prefill 150 (96.8%)", "Preemptions: 2",
                 "peak 40/100 blocks (40.0%)", "Steps with prefill: 2 steps", "Trace: 6 events"):
        assert text in out, text
    assert run_cli(["profile", "summarize", str(d), "--json", "--top", "2"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert len(js["trace"]["top_ops"]) == 2 and js["steps"]["num_steps"] == 5


def test_appended_runs_and_missing_trace(tmp_path, capsys):
    d = write_dir(tmp_path, steps=STEPS + STEPS[:2], trace=False)
    assert [len(r) for r in split_runs(STEPS + STEPS[:2])] == [5, 2]
    s = summarize_profile_dir(str(d), last_run=True)
    assert s["trace"] is None and s["steps"]["num_runs"] == 2 and s["steps"]["num_steps"] == 2
    assert run_cli(["profile", "summarize", str(d)]) == 0
    out = capsys.readouterr().out
    assert "trace.json: absent" in out and "2 runs" in out


def test_errors(tmp_path, capsys):
    with pytest.raises(ProfileError, match="not found"):
        summarize_profile_dir(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert run_cli(["profile", "summarize", str(tmp_path / "empty")]) == 1
    assert "neither steps.jsonl nor trace.json" in capsys.readouterr().err
    d = tmp_path / "bad"
    d.mkdir()
    good = msgspec.json.encode(STEPS[0]).decode()
    (d / "steps.jsonl").write_text(good + "\nnot json\n")
    with pytest.raises(ProfileError, match="line 2"):
        summarize_profile_dir(str(d))
    # a line that is JSON but not a step record: the file, the line and the field are named
    (d / "steps.jsonl").write_text(good + "\n\n" + '{"step": 0}\n')
    with pytest.raises(ProfileError, match=r"steps\.jsonl, line 3: not a step record.*`ts`"):
        summarize_profile_dir(str(d))
    (d / "steps.jsonl").write_text(good.replace('"num_reqs":2', '"num_reqs":"2"') + "\n")
    with pytest.raises(ProfileError, match=r"line 1: .*num_reqs"):
        summarize_profile_dir(str(d))


def test_writer_output_round_trips_through_reader(tmp_path):
    # StepProfiler (the engine's writer) and load_steps (the reader) share StepRecord:
    # every record the writer appends decodes back equal, across two appended runs.
    d = tmp_path / "prof"
    for run in (STEPS, STEPS[:2]):
        prof = StepProfiler(str(d), trace_start_step=10**9)  # no torch.profiler window
        for rec in run:
            prof.after_step(rec)
        prof.close()
    back = load_steps(str(d / "steps.jsonl"))
    assert back == STEPS + STEPS[:2]
    assert all(type(r) is StepRecord for r in back)
    assert [len(r) for r in split_runs(back)] == [5, 2]
    assert summarize_profile_dir(str(d), last_run=True)["steps"]["num_steps"] == 2
    # one JSON object per line, with every field of the schema
    first = json.loads((d / "steps.jsonl").read_text().splitlines()[0])
    assert set(first) == set(StepRecord.__struct_fields__)


def test_reader_ignores_unknown_keys(tmp_path):
    d = tmp_path / "prof"
    d.mkdir()
    rec = json.loads(msgspec.json.encode(STEPS[0]))
    rec["added_by_a_newer_writer"] = 1
    (d / "steps.jsonl").write_text(json.dumps(rec) + "\n")
    assert load_steps(str(d / "steps.jsonl")) == [STEPS[0]]


def test_profiler_window_span_is_ignored(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    ev = [{"ph": "X", "name": "PyTorch Profiler (0)", "cat": "Trace", "pid": "Spans", "tid": 1, "ts": 0, "dur": 1000},
          {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 10, "dur": 500}]
    (d / "trace.json").write_text(json.dumps({"traceEvents": ev}))
    tr = summarize_profile_dir(str(d))["trace"]
    assert [o["name"] for o in tr["top_ops"]] == ["aten::mm"] and tr["num_events"] == 1
