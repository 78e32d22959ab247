"""The load model of ``bench serve``: abandoned streams (``--abort-fraction``,
``--abort-after``), the tokens of retried attempts, and live progress, against the fake
server, which reports what it streamed before a client went away."""

import io
import json

import numpy as np
import pytest
from bench_helpers import check_png, run_cli

from pagedllm.benchmarks.load_model import AbortAfter, AbortPlan, parse_abort_after
from pagedllm.benchmarks.metrics import RequestResult
from pagedllm.benchmarks.progress import RunProgress


def serve(srv, out, *extra):
    return run_cli(["bench", "serve", "--base-url", srv.url, "--quiet", "--input-len", "4",
                    "--save-result", str(out), *extra])


# -- the --abort-after grammar ---------------------------------------------------------------

def test_abort_after_grammar():
    assert parse_abort_after("uniform:0.1,0.9") == AbortAfter("uniform", 0.1, 0.9)
    assert parse_abort_after(" Tokens:12 ") == AbortAfter("tokens", 12)
    assert parse_abort_after("exp:40") == AbortAfter("exp", 40.0)
    for bad, why in (("uniform:0.9,0.1", "LO <= HI"), ("uniform:0.5", "two fractions"),
                     ("uniform:0,1.5", "LO <= HI <= 1"), ("tokens:0", "N >= 1"), ("tokens:2.5", "integer"),
                     ("exp:0", "mean > 0"), ("exp:1,2", "one number"), ("normal:3", "expected"),
                     ("tokens", "expected"), ("tokens:x", "not a number"), ("exp:inf", "finite")):
        with pytest.raises(ValueError, match="--abort-after") as e:
            parse_abort_after(bad)
        assert why in str(e.value), (bad, str(e.value))


def test_abort_draws_are_seeded_per_request():
    plan = AbortPlan(0.5, "uniform:0,1", seed=3)
    draws = [plan.abort_after(f"s{i}", 0, 100) for i in range(2000)]
    # the same request draws the same cut-off, whatever the order of asking
    assert draws[::-1] == [plan.abort_after(f"s{i}", 0, 100) for i in reversed(range(2000))]
    assert AbortPlan(0.5, "uniform:0,1", seed=3).abort_after("s7", 0, 100) == draws[7]
    assert [AbortPlan(0.5, "uniform:0,1", seed=4).abort_after(f"s{i}", 0, 100) for i in range(200)] != draws[:200]
    abandoned = [k for k in draws if k is not None]
    assert 0.45 < len(abandoned) / 2000 < 0.55  # ~F of the requests, each once
    assert min(abandoned) >= 1 and max(abandoned) <= 99  # a cut-off at max_tokens reads to the end
    assert 40 < np.mean(abandoned) < 60
    # fixed count; no abandonment at fraction 0; exponential mean in tokens (rounded up: +0.5)
    assert {AbortPlan(1.0, "tokens:4").abort_after(f"s{i}", t, 10) for i in range(20) for t in range(3)} == {4}
    assert AbortPlan(1.0, "tokens:4").abort_after("s", 0, 4) is None
    assert all(AbortPlan(0.0).abort_after(f"s{i}", 0, 10) is None for i in range(50))
    exp = [AbortPlan(1.0, "exp:20").abort_after(f"s{i}", 0, 10_000) for i in range(4000)]
    assert 19.0 < np.mean(exp) < 22.5
    uni = [AbortPlan(1.0, "uniform:0.5,0.5").abort_after(f"s{i}", 0, 10) for i in range(10)]
    assert uni == [5] * 10
    # a trace turn's own cut-off overrides the flags, either way
    assert AbortPlan(0.0).abort_after("s", 0, 10, override=3) == 3
    assert AbortPlan(1.0, "tokens:2").abort_after("s", 0, 10, override=10) is None
    with pytest.raises(ValueError, match="--abort-fraction"):
        AbortPlan(1.5)


@pytest.mark.parametrize("flags, needle", [
    (["--abort-fraction", "1.5"], "--abort-fraction"),
    (["--abort-fraction", "0.5", "--abort-after", "tokens:0"], "--abort-after"),
    (["--abort-after", "tokens:3"], "--abort-fraction > 0"),
])
def test_bad_abort_flags_name_the_flag(flags, needle, capsys):
    assert run_cli(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", *flags]) == 2
    assert needle in capsys.readouterr().err


# -- abandoned streams and retried attempts, counted exactly ---------------------------------

def test_abandoned_streams_counted_exactly(fake_server, tmp_path):
    srv = fake_server(prefill_s=0.001, itl_s=0.02)
    out = tmp_path / "r.json"
    assert serve(srv, out, "--num-prompts", "4", "--output-len", "10", "--max-concurrency", "2",
                 "--abort-fraction", "1", "--abort-after", "tokens:3") == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    srv.wait_idle()
    assert all(r["aborted"] and r["aborted_output_tokens"] == r["output_tokens"] == 3 and r["error"] is None
               and r["success"] is False and r["tpot_ms"] is None for r in res["requests"])
    # the server streamed exactly what the client read, then saw it go away
    assert srv.stats.disconnects == [3, 3, 3, 3] and srv.stats.success == 0
    assert s["aborted"] == 4 and s["abort_rate"] == 1.0 and s["total_aborted_output_tokens"] == 12
    # not failures: no error rate, no error list; TTFT counted, TPOT/ITL/E2E not
    assert s["failed"] == 0 and s["error_rate"] == 0.0 and s["errors"] == {} and s["completed"] == 0
    assert s["ttft_ms"]["count"] == 4 and s["tpot_ms"]["count"] == 0 and s["e2e_ms"]["count"] == 0
    assert s["itl_ms"]["count"] == 0 and s["total_output_tokens"] == 0

    # half abandoned, anywhere in the stream: each cut-off is where the client and server stopped
    srv = fake_server(prefill_s=0.001, itl_s=0.02)
    assert serve(srv, out, "--num-prompts", "12", "--output-len", "10", "--max-concurrency", "4",
                 "--abort-fraction", "0.5", "--abort-after", "uniform:0.1,0.9", "--seed", "5") == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    srv.wait_idle()
    aborted = [r for r in res["requests"] if r["aborted"]]
    assert 0 < len(aborted) < 12 and s["aborted"] == len(aborted) and s["completed"] == 12 - len(aborted)
    assert all(r["aborted_output_tokens"] == r["abort_after_tokens"] for r in aborted)
    assert sorted(srv.stats.disconnects) == sorted(r["aborted_output_tokens"] for r in aborted)
    assert s["total_aborted_output_tokens"] == sum(srv.stats.disconnects)
    assert s["total_output_tokens"] == 10 * s["completed"] and s["tpot_ms"]["count"] == s["completed"]
    assert s["ttft_ms"]["count"] == 12
    # the same seed abandons the same requests at the same token
    srv2 = fake_server(prefill_s=0.001, itl_s=0.02)
    out2 = tmp_path / "r2.json"
    assert serve(srv2, out2, "--num-prompts", "12", "--output-len", "10", "--max-concurrency", "4",
                 "--abort-fraction", "0.5", "--abort-after", "uniform:0.1,0.9", "--seed", "5") == 0
    again = json.loads(out2.read_text())["requests"]
    assert [r["abort_after_tokens"] for r in again] == [r["abort_after_tokens"] for r in res["requests"]]


def test_abandoned_turn_keeps_its_session_going(fake_server, tmp_path, word_tokenizer):
    srv = fake_server(prefill_s=0.001, itl_s=0.01)
    out = tmp_path / "r.json"
    assert serve(srv, out, "--dataset", "multi-turn", "--num-prompts", "2", "--multi-turn-turns", "3",
                 "--multi-turn-system-len", "4", "--multi-turn-tool-len", "2", "--multi-turn-think-time", "0",
                 "--output-len", "6", "--abort-fraction", "1", "--abort-after", "tokens:2") == 0
    s = json.loads(out.read_text())["summary"]
    assert s["num_requests"] == 6 and s["aborted"] == 6
    later = [r["body"]["messages"] for r in srv.stats.requests if len(r["body"]["messages"]) > 3]
    assert later and all({"role": "assistant", "content": " tok0 tok1"} in m for m in later)


def test_retried_attempts_tokens_counted_exactly(fake_server, tmp_path):
    # the first attempts of the 1st and 3rd requests drop their connection after 3 and 5 tokens
    srv = fake_server(prefill_s=0.001, itl_s=0.005, drop_first_attempt={0: 3, 2: 5})
    out = tmp_path / "r.json"
    assert serve(srv, out, "--num-prompts", "4", "--output-len", "8", "--max-concurrency", "1",
                 "--max-retries", "2", "--retry-backoff", "0") == 0
    res = json.loads(out.read_text())
    s, reqs = res["summary"], res["requests"]
    assert srv.stats.dropped == [3, 5] and len(srv.stats.requests) == 6
    assert [r["retries"] for r in reqs] == [1, 0, 1, 0]
    assert [r["retried_output_tokens"] for r in reqs] == [3, 0, 5, 0]
    assert [r["retried_prompt_tokens"] for r in reqs] == [4, 0, 4, 0]
    assert all(r["success"] and r["output_tokens"] == 8 for r in reqs)
    assert s["total_retried_output_tokens"] == 8 and s["total_retried_prompt_tokens"] == 8
    assert s["retry_rate"] == 0.5 and s["failed"] == 0 and s["total_output_tokens"] == 32

    # refused before streaming (HTTP 503): retried, but the server took no prompt
    srv = fake_server(prefill_s=0.001, itl_s=0.001, fail_first_n=1)
    assert serve(srv, out, "--num-prompts", "2", "--output-len", "2", "--max-concurrency", "1",
                 "--max-retries", "1", "--retry-backoff", "0") == 0
    s = json.loads(out.read_text())["summary"]
    assert s["total_retries"] == 1 and s["total_retried_prompt_tokens"] == 0
    assert s["total_retried_output_tokens"] == 0


def test_report_table_shows_rates(fake_server, tmp_path, capsys):
    srv = fake_server(prefill_s=0.001, itl_s=0.01, drop_first_attempt={0: 2})
    assert serve(srv, tmp_path / "r.json", "--num-prompts", "4", "--output-len", "6", "--max-concurrency", "1",
                 "--max-retries", "1", "--retry-backoff", "0", "--abort-fraction", "1",
                 "--abort-after", "tokens:4") == 0
    table = capsys.readouterr().out
    lines = {ln.rsplit(None, 1)[0].strip(): ln.rsplit(None, 1)[1] for ln in table.splitlines()
             if ln.strip() and not ln.startswith(("=", "-"))}
    assert lines["Abandoned streams"] == "4" and lines["Abandoned-stream rate"] == "100.00%"
    assert lines["Output tokens read before abandoning"] == "16"
    assert lines["Retry rate (requests retried)"] == "25.00%" and lines["Retried attempts: output tokens"] == "2"


# -- live progress ---------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def done(tokens, success=True):
    return RequestResult(0, success=success, output_tokens=tokens)


def test_progress_plain_lines_rate_and_eta():
    clock, buf = Clock(), io.StringIO()
    p = RunProgress("requests", 20, stream=buf, clock=clock, window_s=10.0)
    for i in range(20):
        clock.t = i + 1.0
        p.update(done(10))
        if i == 3:
            # 4 of 20 after 4 s: 40 tokens over 4 s; 16 left at 1 s each
            assert p.line() == "requests: 4/20 requests (20%), 10.0 output tok/s, 4s elapsed, ETA 16s"
    p.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 10  # one per 10 %, none repeated at close
    assert lines[0].startswith("requests: 2/20 requests (10%)") and lines[-1].startswith("requests: 20/20")
    assert "ETA 0s" in lines[-1]
    # the current rate is over the last window_s: at t=25, the requests done at t=15..20
    clock.t = 25.0
    assert p.tokens_per_s() == pytest.approx(6 * 10 / 10.0)
    # failed requests count as done, not as tokens; no total: time-based steps of a duration
    clock.t, buf = 0.0, io.StringIO()
    p = RunProgress("d", None, duration_s=100.0, stream=buf, clock=clock)
    clock.t = 35.0
    p.update(done(5, success=False))
    p.close()
    assert buf.getvalue().splitlines() == ["d: 1 requests, 0.0 output tok/s, 35s elapsed, ETA 1m05s"] * 2


def test_serve_prints_progress_lines_when_not_a_tty(fake_server, tmp_path, capsys):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    argv = ["bench", "serve", "--base-url", srv.url, "--num-prompts", "20", "--input-len", "4", "--output-len", "3",
            "--max-concurrency", "2"]
    assert run_cli(argv) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "/20 requests (" in ln]
    assert [ln.split("/")[0] for ln in lines] == [f"requests: {k}" for k in range(2, 21, 2)]
    assert "\r" not in err  # no bar in a log
    assert run_cli(argv + ["--no-progress"]) == 0
    assert "/20 requests" not in capsys.readouterr().err


def test_sweep_prints_each_point_and_its_progress(fake_server, capsys):
    srv = fake_server(prefill_s=0.001, itl_s=0.001)
    assert run_cli(["bench", "sweep", "--base-url", srv.url, "--num-prompts", "10", "--input-len", "4",
                    "--output-len", "2", "--concurrencies", "1,2,3", "--slo", "ttft:10000", "--label", "x"]) == 0
    err = capsys.readouterr().err.splitlines()
    for k, c in enumerate((1, 2, 3), 1):
        assert f"[sweep x] point {k} (of up to 3): concurrency {c}" in err
        assert sum(ln.startswith(f"[sweep x] concurrency {c}: ") and "/10 requests (" in ln for ln in err) == 10
        assert any(ln.startswith(f"[sweep x] concurrency {c}: ") and "meets SLO" in ln for ln in err)


# -- --compare ---------------------------------------------------------------------------------

def test_compare_two_servers_orders_the_table(fake_server, tmp_path, capsys):
    fast = fake_server(prefill_s=0.005, itl_s=0.002)
    slow = fake_server(prefill_s=0.06, itl_s=0.012)
    out = tmp_path / "c.json"
    rc = run_cli(["bench", "serve", "--base-url", fast.url, "--compare", slow.url, "--labels", "fast,slow",
                  "--compare-rounds", "2", "--num-prompts", "6", "--input-len", "4", "--output-len", "5",
                  "--max-concurrency", "2", "--abort-fraction", "0.5", "--abort-after", "tokens:2", "--quiet",
                  "--save-result", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == "A = fast; B = slow; 2 rounds, A and B in turns"
    cells = {ln[:40].strip(): ln[40:].split() for ln in table.splitlines()[3:]}
    for name in ("TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "E2E p50 (ms)"):
        a, b, ratio, better = cells[name]
        assert float(a) < float(b) and float(ratio[:-1]) > 1 and better == "A", name
    assert cells["Output token throughput (tok/s)"][-1] == "A"
    res = json.loads(out.read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert rows["TTFT p50 (ms)"]["winner"] == "A" and rows["TTFT p50 (ms)"]["better"] == "lower"
    assert rows["TTFT p50 (ms)"]["ratio"] > 3  # prefill 60 ms against 5 ms, both plus overhead
    # each side pooled its two rounds; the rounds took turns: A, B, then B, A
    a, b = res["results"]
    assert a["summary"]["num_requests"] == b["summary"]["num_requests"] == 12
    assert [r["request_id"] for r in a["requests"]] == list(range(12))
    assert len(fast.stats.requests) == len(slow.stats.requests) == 12
    arr = lambda srv: [r["arrival"] for r in srv.stats.requests]  # noqa: E731
    assert max(arr(fast)[:6]) < min(arr(slow)) and max(arr(slow)) < max(arr(fast))
    assert min(arr(fast)[6:]) > max(arr(slow))
    # the same requests abandoned on both sides
    assert [r["abort_after_tokens"] for r in a["requests"]] == [r["abort_after_tokens"] for r in b["requests"]]
    assert rows["Abandoned-stream rate"]["a"] == rows["Abandoned-stream rate"]["b"] > 0
    check_png(tmp_path / "plots" / "compare.png")


def test_compare_cost_rows_hook(monkeypatch):
    import sys
    import types

    from pagedllm.benchmarks.compare import CompareRow, compare_rows, format_compare

    def summary(ttft, tok_s):
        st = {"median": ttft, "p99": ttft * 2}
        return {"summary": {"completed": 3, "request_throughput": 1.0, "output_token_throughput": tok_s,
                            "ttft_ms": st, "tpot_ms": st, "e2e_ms": st, "error_rate": 0.0, "retry_rate": 0.0,
                            "abort_rate": 0.0, "goodput": None},
                "server_metrics": {"prefix_cache_hit_rate": None}}

    a, b = summary(10.0, 100.0), summary(20.0, 50.0)
    assert [r.name for r in compare_rows(a, b)][-1] == "Prefix cache hit rate (server)"  # no cost rows
    cost = types.ModuleType("pagedllm.benchmarks.cost")
    cost.compare_cost_rows = lambda x, y: [("$ per 1M output tokens", 2.0, 4.0, ".4f", "lower")]
    monkeypatch.setitem(sys.modules, "pagedllm.benchmarks.cost", cost)
    rows = compare_rows(a, b)
    assert rows[-1] == CompareRow("$ per 1M output tokens", 2.0, 4.0, ".4f", "lower")
    assert rows[-1].ratio() == 2.0 and rows[-1].winner() == "A"
    line = format_compare(rows, ["x", "y"]).splitlines()[-1]
    assert line.split() == ["$", "per", "1M", "output", "tokens", "2.0000", "4.0000", "2.00x", "A"]


def test_compare_flag_errors(capsys):
    base = ["bench", "serve", "--model", "m", "--num-prompts", "1"]
    for extra, needle in ((["--compare", "localhost:9"], "--compare must be a URL"),
                          (["--compare-model", "x"], "--compare-model goes with --compare"),
                          (["--compare", "http://127.0.0.1:9", "--labels", "a"], "--labels"),
                          (["--compare-rounds", "2"], "go with --compare or --compare-args"),
                          (["--compare-args=--port 9", "--compare-args="], "--port is set by the bench"),
                          (["--compare-args=--no-such-flag", "--compare-args="], "--compare-args '--no-such-flag'"),
                          (["--compare-args=--max-num-seqs x", "--compare-args="], "invalid int value"),
                          (["--compare-args='unclosed", "--compare-args="], "No closing quotation"),
                          (["--compare-args=--max-num-seqs 4"], "give it twice"),
                          (["--compare", "http://127.0.0.1:9", "--endpoint-type", "chat,messages"],
                           "compare two servers on one endpoint type")):
        assert run_cli(base + extra) == 2, extra
        assert needle in capsys.readouterr().err, extra


def test_compare_args_starts_and_stops_two_servers(fake_server, monkeypatch, tmp_path, capsys):
    from pagedllm.benchmarks import server

    servers = [fake_server(prefill_s=0.001, itl_s=0.001), fake_server(prefill_s=0.03, itl_s=0.001)]
    started, stopped = [], []

    class Proc:
        def poll(self):
            return None

        def terminate(self):
            stopped.append(self)

        def wait(self, timeout=None):
            return 0

    def start(words, engine_process=None):
        started.append(words)
        return Proc(), servers[len(started) - 1].url

    monkeypatch.setattr(server, "start_server", start)
    assert run_cli(["bench", "serve", "--compare-args=", "--compare-args=--no-enable-prefix-caching --max-num-seqs 4",
                    "--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--quiet"]) == 0
    assert started == [[], ["--no-enable-prefix-caching", "--max-num-seqs", "4"]] and len(stopped) == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "A = pagedllm serve; B = pagedllm serve --no-enable-prefix-caching --max-num-seqs 4"
    assert next(ln for ln in lines if ln.startswith("TTFT p50")).split()[-1] == "A"
    assert len(servers[0].stats.requests) == len(servers[1].stats.requests) == 3


def test_new_flags_are_documented():
    import os
    import re

    from pagedllm.entrypoints.cli import build_parser

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "notes", "benchmarks.md"), encoding="utf-8") as f:
        named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", f.read()))
    flags = {"--abort-fraction", "--abort-after", "--no-progress", "--compare", "--compare-args", "--compare-model",
             "--compare-rounds", "--labels"}
    bench = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "bench" in a.choices)
    sub = next(a for a in bench.choices["bench"]._actions if hasattr(a, "choices") and a.choices)
    have = {o for a in sub.choices["serve"]._actions for o in a.option_strings}
    assert flags <= have and not flags - named, sorted(flags - named)


def test_progress_bar_on_a_terminal():
    buf = io.StringIO()
    p = RunProgress("[sweep x] rate 2", 5, stream=buf, tty=True)
    assert p.bar is not None
    for _ in range(5):
        p.update(done(7))
    assert p.bar.n == 5 and p.bar.total == 5 and "out tok/s" in p.bar.postfix
    p.close()
    out = buf.getvalue()
    assert "[sweep x] rate 2" in out and "\r" in out  # a bar redrawn in place, not log lines
    assert "requests (" not in out


def test_goodput_fraction_leaves_abandoned_streams_out():
    from pagedllm.benchmarks.metrics import summarize_results

    ok = RequestResult(0, success=True, output_tokens=4, ttft=0.1, e2e=0.4, start_time=0, end_time=0.4)
    ab = RequestResult(1, aborted=True, output_tokens=2, aborted_output_tokens=2, ttft=0.2, e2e=0.3)
    s = summarize_results([ok, ab], 1.0, {"ttft": 1000.0})
    assert s["good_requests"] == 1 and s["goodput_fraction"] == 1.0 and s["goodput"] == 1.0
    assert s["ttft_ms"]["count"] == 2 and s["e2e_ms"]["count"] == 1 and s["abort_rate"] == 0.5


def test_pool_runs_lays_rounds_end_to_end():
    """A side's rounds pooled: the other side's turn between them is cut out, so the pooled
    run lasts the sum of its rounds (what the cost attribution clips busy time to)."""
    from pagedllm.benchmarks.compare import pool_runs
    from pagedllm.benchmarks.runner import LoadRun

    def run(t0, t_end, n):
        rs = [RequestResult(request_id=i, scheduled_time=t0 + i, start_time=t0 + i, first_token_time=t0 + i + 0.5,
                            end_time=t0 + i + 1) for i in range(n)]
        return LoadRun(rs, 0, t0, t_end, 0.0, None, None, "chat", n)

    pooled = pool_runs([run(100.0, 102.0, 2), run(110.0, 113.0, 3)])  # B ran in [102, 110]
    assert pooled.measured_s == 5.0 and pooled.t_end - pooled.t0 == 5.0
    assert [r.request_id for r in pooled.results] == [0, 1, 2, 3, 4]
    assert [r.start_time for r in pooled.results] == [100.0, 101.0, 102.0, 103.0, 104.0]
    assert pooled.results[-1].end_time == 105.0 and pooled.results[2].first_token_time == 102.5
    d = pooled.results[3].to_dict(pooled.t0)
    assert d["start_s"] == 3.0 and d["end_s"] == 4.0
