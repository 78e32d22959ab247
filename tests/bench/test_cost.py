"""Cost attribution, drivers, what-if and the managed-API break-even (``pagedllm.benchmarks.cost``):
exact arithmetic on hand-made records, and shares that add up against the fake server."""

import json

import pytest
from bench_helpers import check_png, run_cli

from pagedllm.benchmarks.cost import (ApiPrice, analyze, api_cost_usd, break_even_utilisation, compare_cost_rows,
                                      format_cost, parse_api_price, union_length)


def rec(rid, sid, *, ok=True, aborted=False, prompt=0, cached=None, out=0, aborted_out=0, r_prompt=0, r_out=0,
        sched=0.0, start=0.0, first=None, end=0.0, think=0.0, system=None, retries=0):
    """A request record as ``RequestResult.to_dict`` writes it."""
    return {"request_id": rid, "session_id": sid, "turn": 0, "success": ok and not aborted, "error": None,
            "http_status": 200, "retries": retries, "prompt_tokens": prompt, "output_tokens": out,
            "output_tokens_source": "usage", "cached_tokens": cached, "aborted": aborted,
            "aborted_output_tokens": aborted_out, "retried_prompt_tokens": r_prompt, "retried_output_tokens": r_out,
            "think_time_s": think, "system_tokens": system, "scheduled_s": sched, "start_s": start,
            "first_token_s": first, "end_s": end}


def known_run():
    """100 s; busy [0, 40] and [60, 70]; a tool wait [50, 60]; server prefill/decode sums 20/80 s,
    queue 4 s, hit rate 0.5, 40 generated tokens no record received."""
    reqs = [
        rec(0, "a", prompt=1000, cached=600, out=100, start=0, first=1, end=10, system=300),
        rec(1, "b", prompt=1000, cached=600, out=100, start=0, first=2, end=20, system=300),
        rec(2, "c", prompt=2000, cached=1000, out=200, r_prompt=500, r_out=10, retries=1, sched=5, start=5, first=8,
            end=30, system=300),
        rec(3, "a", aborted=True, prompt=1000, out=30, aborted_out=30, sched=10, start=10, first=12, end=15,
            system=300),
        rec(4, "d", ok=False, prompt=800, r_prompt=1000, r_out=20, retries=2, sched=20, start=20, end=40),
        rec(5, "a", prompt=1000, cached=0, out=50, sched=60, start=60, first=61, end=70, think=10, system=300),
    ]
    reqs[4]["error"] = "HTTP 503"
    return {"summary": {"duration_s": 100.0, "output_token_throughput": 4.5},
            "server_metrics": {"available": True, "prefill_sum_s": 20.0, "decode_sum_s": 80.0, "queue_sum_s": 4.0,
                               "prefix_cache_queries": 2.0, "prefix_cache_hits": 1.0, "generation_tokens": 550.0,
                               "num_preemptions": 0.0, "finished_reasons": {"length": 4, "abort": 1}},
            "requests": reqs}


def test_known_run_attribution_exact():
    c = analyze(known_run(), cost_per_hour=36.0)
    t = c["tokens"]
    # delivered: 4 requests; the abandoned one's cache figure is the server's hit rate (0.5)
    assert (t["prompt_delivered"], t["prompt_cached_delivered"], t["output_delivered"]) == (5000, 2200, 450)
    assert (t["prompt_aborted"], t["prompt_cached_aborted"], t["output_aborted"]) == (1000, 500, 30)
    assert (t["prompt_retried"], t["output_retried"], t["never_received"]) == (1500, 30, 40)
    assert t["prompt_computed"] == 2800 + 500 + 1500 and t["output_generated"] == 550
    assert c["engine_time_model"] == "server" and c["prefix_cache"]["source"] == "usage"
    assert c["busy_s"] == 50 and c["prefill_share_of_busy"] == pytest.approx(0.2)
    cp, cd = 10 / 4800, 40 / 550
    assert c["s_per_computed_prompt_token"] == pytest.approx(cp) and c["s_per_output_token"] == pytest.approx(cd)
    rows = {r["key"]: r for r in c["rows"]}
    expect = {"prompt_computed": (2800, 2800 * cp), "prompt_cached": (2200, 0.0), "output_delivered": (450, 450 * cd),
              "retried": (1530, 1500 * cp + 30 * cd), "aborted": (1030, 500 * cp + 30 * cd),
              "never_received": (40, 40 * cd), "idle_tool_wait": (None, 10.0), "idle": (None, 40.0)}
    assert set(rows) == set(expect)
    for k, (tok, sec) in expect.items():
        assert rows[k]["tokens"] == tok and rows[k]["seconds"] == pytest.approx(sec), k
        assert rows[k]["usd"] == pytest.approx(sec * 0.01), k
    # the shares add up to the whole
    assert sum(r["seconds"] for r in c["rows"]) == pytest.approx(100.0, abs=1e-9)
    assert sum(r["time_share"] for r in c["rows"]) == pytest.approx(1.0, abs=1e-12)
    assert sum(r["token_share"] for r in c["rows"] if r["token_share"] is not None) == pytest.approx(1.0, abs=1e-12)
    assert c["tokens"]["total"] == 8050
    assert c["prefix_cache"]["cached_tokens"] == 2700 and c["prefix_cache"]["saved_engine_s"] == pytest.approx(2700 * cp)
    m = c["money"]
    assert m["run_usd"] == pytest.approx(1.0) and m["usd_per_1m_output_tokens"] == pytest.approx(1e6 / 450)
    assert m["usd_per_request"] == pytest.approx(0.25) and m["usd_per_session"] == pytest.approx(0.25)
    # sessions' time: every second of sum(end - scheduled) + think time, once
    st = {r["key"]: r["seconds"] for r in c["session_time"]["rows"]}
    assert st == pytest.approx({"tool_wait": 10, "client_wait": 0, "server_queue": 4, "prefill": 5, "decode": 58,
                                "aborted": 3, "failed": 20})
    assert c["session_time"]["total_s"] == pytest.approx(100.0)
    assert c["server"]["aborts_counted_by_server"] == 1 and c["server"]["aborted_streams_client"] == 1


def test_known_run_drivers_add_up():
    c = analyze(known_run(), cost_per_hour=36.0)
    loaded = 100 / (50 - 40 * 40 / 550)      # machine s per engine s of the records' own tokens
    assert c["machine_s_per_engine_s"] == pytest.approx(loaded)
    pl = {g["bucket"]: g for g in c["drivers"]["prompt_length"]}
    assert set(pl) == {"<1k", "1k-4k"} and pl["1k-4k"]["requests"] == 1 and pl["<1k"]["requests"] == 5
    cp, cd = 10 / 4800, 40 / 550
    assert pl["1k-4k"]["machine_s"] == pytest.approx((1000 * cp + 200 * cd + 500 * cp + 10 * cd) * loaded)
    assert sum(g["share"] for g in pl.values()) == pytest.approx(1.0)
    ss = c["drivers"]["sessions"]
    assert ss["count"] == 4 and sum(d["machine_s"] for d in ss["per_session"].values()) == pytest.approx(100.0)
    assert ss["per_session"]["a"]["requests"] == 3 and ss["top"][0]["session_id"] in ("a", "c")
    sysp = c["drivers"]["system_prompt"]
    assert [g["bucket"] for g in sysp] == ["300 tokens"] and sysp[0]["requests"] == 5


def test_known_run_what_if_arithmetic():
    c = analyze(known_run(), cost_per_hour=36.0, what_if_system_len=100)
    cp, cd = 10 / 4800, 40 / 550
    loaded = 100 / (50 - 40 * cd)
    w = {x["key"]: x for x in c["what_if"]}
    s = w["system_prompt"]
    # 5 requests reached the engine with a 300-token system prompt: 5 x 200 tokens cut
    assert (s["from_tokens"], s["to_tokens"], s["prompt_tokens_cut"]) == (300, 100, 1000)
    assert s["saving_uncached"]["engine_s"] == pytest.approx(1000 * cp)
    assert s["saving_uncached"]["usd"] == pytest.approx(1000 * cp * loaded * 0.01)
    assert s["saving_uncached"]["usd_per_1m_output_tokens"] == pytest.approx(1000 * cp * loaded * 0.01 / 450 * 1e6)
    hit = 2700 / 6000
    assert s["run_hit_rate"] == pytest.approx(hit)
    assert s["saving_cached_at_run_hit_rate"]["engine_s"] == pytest.approx(1000 * (1 - hit) * cp)
    assert "from 300 to 100 tokens" in s["statement"] and "1,000 prompt tokens" in s["arithmetic"][0]
    r = w["fewer_retries"]
    assert r["saving"]["engine_s"] == pytest.approx(0.05 * (1500 * cp + 30 * cd))
    assert r["saving"]["usd"] == pytest.approx(0.05 * (1500 * cp + 30 * cd) * loaded * 0.01)
    p = w["prefix_cache_off"]
    assert p["extra"]["engine_s"] == pytest.approx(2700 * cp)
    assert p["extra"]["usd_per_1m_output_tokens"] == pytest.approx(2700 * cp * loaded * 0.01 / 450 * 1e6)
    # default target: a third of the run's system prompt
    assert {x["key"]: x for x in analyze(known_run())["what_if"]}["system_prompt"]["to_tokens"] == 100
    text = format_cost(c)
    for words in ("cutting the system prompt from 300 to 100 tokens", "5% fewer retried attempts",
                  "prefix caching off would cost", "assumes:"):
        assert words in text


def test_break_even_arithmetic():
    assert api_cost_usd(ApiPrice(1.0, 2.0, 0.5), 3e6, 1e6, 1e6) == pytest.approx(3 + 0.5 + 2)
    assert api_cost_usd(ApiPrice(1.0, 2.0), 3e6, 1e6, 1e6) == pytest.approx(3 + 1 + 2)
    # $0.9/h at 100 tok/s costs $2.5 per 1M at full use; an API at $5 per 1M output tokens: u* = 0.5
    assert break_even_utilisation(0.9, 100.0, 5e-6) == pytest.approx(0.5, rel=1e-12)
    assert break_even_utilisation(3.6, 100.0, 5e-6) == pytest.approx(2.0, rel=1e-12)
    assert break_even_utilisation(1.0, 0.0, 5e-6) is None and break_even_utilisation(1.0, 10.0, 0.0) is None
    # a run: the API bills 4800 uncached, 2700 cached input and 510 output tokens
    c = analyze(known_run(), cost_per_hour=36.0, api_price=ApiPrice(1000.0, 2000.0, 500.0))
    a = c["api"]
    assert a["billed_tokens"] == {"input_uncached": 4800, "input_cached": 2700, "output": 510}
    bill = (4800 * 1000 + 2700 * 500 + 510 * 2000) / 1e6
    assert a["api_usd"] == pytest.approx(bill) and a["api_usd_per_1m_output_tokens"] == pytest.approx(bill / 450 * 1e6)
    assert a["input_per_output_token"] == pytest.approx(7500 / 450)
    # capacity = the run's own 4.5 tok/s: u* = 36 / (3600 * 4.5 * bill / 450) = run $ / API $
    assert a["capacity_output_tok_s"] == 4.5 and a["break_even_utilisation"] == pytest.approx(1.0 / bill)
    assert a["self_host_usd_per_1m_output_tokens_at_capacity"] == pytest.approx(36 / 3600 / 4.5 * 1e6)
    assert "self-hosting is cheaper above 13.9% utilisation" in format_cost(c)
    c = analyze(known_run(), cost_per_hour=36.0, api_price=ApiPrice(1.0, 2.0), capacity_tok_s=9.0)
    assert c["api"]["break_even_utilisation"] > 1 and "never at this capacity" in format_cost(c)
    assert analyze(known_run(), api_price=ApiPrice(1.0, 2.0))["api"]["break_even_utilisation"] is None


def test_abandoned_and_retried_tokens_counted_exactly():
    reqs = [rec(i, f"s{i}", prompt=100, cached=40, out=10, start=i, first=i + 0.1, end=i + 1) for i in range(3)]
    reqs += [rec(3, "s3", aborted=True, prompt=100, cached=40, out=7, aborted_out=7, start=0, first=0.1, end=0.5),
             rec(4, "s4", aborted=True, prompt=100, out=0, aborted_out=0, start=0, end=0.2),
             rec(5, "s5", prompt=100, cached=40, out=10, r_prompt=200, r_out=13, retries=2, start=1, first=1.2, end=2)]
    res = {"summary": {"duration_s": 3.0}, "server_metrics": {"available": False}, "requests": reqs}
    c = analyze(res)
    rows = {r["key"]: r for r in c["rows"]}
    assert rows["aborted"]["tokens"] == 100 + 7 + 100 and c["tokens"]["output_aborted"] == 7
    assert rows["retried"]["tokens"] == 200 + 13
    assert rows["output_delivered"]["tokens"] == 40 and rows["never_received"]["tokens"] == 0
    assert c["counts"] == {"requests": 6, "completed": 4, "sessions": 6, "aborted": 2}
    # no /metrics: the split comes from the client's TTFT and streaming times
    assert c["engine_time_model"] == "client" and c["busy_s"] == pytest.approx(3.0)
    assert sum(r["seconds"] for r in c["rows"]) == pytest.approx(3.0)
    # a failed stream's tokens (the load model records them) get their own row
    reqs.append(rec(6, "s6", ok=False, prompt=50, out=4, start=2, first=2.1, end=2.5))
    c = analyze(res)
    assert {r["key"]: r for r in c["rows"]}["failed"]["tokens"] == 54
    assert sum(r["seconds"] for r in c["rows"]) == pytest.approx(3.0)


def test_union_length():
    assert union_length([(0, 2), (1, 3), (5, 6)], 0, 10) == 4
    assert union_length([(0, 2), (1, 3), (5, 6)], 1.5, 5.5) == pytest.approx(2.0)
    assert union_length([], 0, 1) == 0 and union_length([(3, 2)], 0, 5) == 0


@pytest.mark.parametrize("text, words", [
    ("3", "expected INPUT_PER_1M,OUTPUT_PER_1M"), ("1,2,3,4", "expected"), ("1,,2", "expected"),
    ("a,1", "input price 'a' is not a number"), ("1,-2", "output price must be a finite number >= 0"),
    ("1,2,inf", "cached input price must be"), ("0,0", "both 0")])
def test_api_price_errors_name_the_flag(text, words, capsys):
    with pytest.raises(ValueError) as e:
        parse_api_price(text)
    assert str(e.value).startswith("--api-price: ") and words in str(e.value)
    for cmd in (["bench", "serve"], ["bench", "sweep", "--concurrencies", "1", "--slo", "ttft:1"]):
        with pytest.raises(SystemExit) as ex:
            run_cli([*cmd, "--api-price", text])
        assert ex.value.code == 2
        err = capsys.readouterr().err
        assert "argument --api-price" in err and words in err, err


def test_api_price_parses():
    assert parse_api_price("3,15") == ApiPrice(3.0, 15.0, None) and ApiPrice(3.0, 15.0).cached_rate == 3.0
    assert parse_api_price(" 3 , 15 , 0.3 ").cached_rate == 0.3


def test_cost_flags_checked(capsys):
    assert run_cli(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                    "--cost-per-hour", "-1"]) == 2
    assert "--cost-per-hour" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli(["bench", "serve", "--what-if-system-len", "-3"])
    assert "argument --what-if-system-len" in capsys.readouterr().err


def _abandon(monkeypatch, ids, keep):
    """Records of abandoned streams as the load model makes them, for requests ``ids``
    exactly (``--abort-fraction`` draws by seed): the client reads ``keep`` tokens and
    stops, while this server generates every token regardless (as a server that never
    notices the disconnect would: "generated, never received")."""
    from pagedllm.benchmarks import client as client_mod

    real = client_mod.OpenAIStreamClient.send

    async def send(self, kind, payload, max_tokens, result, est, abort_after=None):
        await real(self, kind, payload, max_tokens, result, est, abort_after)
        if result.request_id in ids:
            result.success, result.aborted = False, True
            result.output_tokens = result.aborted_output_tokens = keep
        return result

    monkeypatch.setattr(client_mod.OpenAIStreamClient, "send", send)


def test_shares_add_up_against_fake_server(fake_server, tmp_path, capsys, monkeypatch):
    """Known latency (10 ms prefill, 4 ms per token, 2 slots), cache (4-token blocks, hits in
    usage and /metrics) and abandon model (requests 2 and 5 read 2 of their 6 tokens)."""
    srv = fake_server(capacity=2, prefill_s=0.01, itl_s=0.004)
    _abandon(monkeypatch, {2, 5}, 2)
    out = tmp_path / "r.json"
    rc = run_cli(["bench", "serve", "--base-url", srv.url, "--quiet", "--dataset", "shared-prefix", "--num-prefixes",
                  "2", "--prefix-len", "16", "--suffix-len", "4", "--output-len", "6", "--num-prompts", "10",
                  "--max-concurrency", "2", "--cost-per-hour", "7.2", "--api-price", "0.5,1.5,0.05",
                  "--save-result", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    res = json.loads(out.read_text())
    c, s, m = res["cost"], res["summary"], res["server_metrics"]
    rows = {r["key"]: r for r in c["rows"]}
    assert c["engine_time_model"] == "server" and c["prefix_cache"]["source"] == "usage"
    assert c["prefill_share_of_busy"] == pytest.approx(m["prefill_sum_s"] / (m["prefill_sum_s"] + m["decode_sum_s"]))
    # cache: the usage figures are the server's hits, token for token
    assert c["prefix_cache"]["cached_tokens"] == m["prefix_cache_hits"] == srv.stats.prefix_hits > 0
    assert rows["prompt_cached"]["tokens"] + rows["aborted"]["tokens"] - 2 * 2 + rows["prompt_computed"]["tokens"] \
        == 10 * 20
    # abandoned: 2 x 2 tokens read; the server generated the other 2 x 4
    assert c["tokens"]["output_aborted"] == 4 and rows["never_received"]["tokens"] == 8
    assert rows["output_delivered"]["tokens"] == 8 * 6 == s["total_output_tokens"]
    assert sum(r["seconds"] for r in c["rows"]) == pytest.approx(s["duration_s"], rel=1e-9)
    assert sum(r["token_share"] for r in c["rows"] if r["token_share"] is not None) == pytest.approx(1.0)
    assert c["busy_share"] > 0.9 and rows["idle_tool_wait"]["seconds"] == 0
    # engine time = cost per computed prompt token x computed + cost per output token x generated
    assert (c["s_per_computed_prompt_token"] * c["tokens"]["prompt_computed"]
            + c["s_per_output_token"] * c["tokens"]["output_generated"]) == pytest.approx(c["busy_s"])
    # money agrees with the sweep's cost_at: cost_per_hour / (3600 * output tok/s) * 1e6
    assert c["money"]["usd_per_1m_output_tokens"] == pytest.approx(7.2 / (3600 * s["output_token_throughput"]) * 1e6)
    assert c["api"]["break_even_utilisation"] == pytest.approx(c["money"]["run_usd"] / c["api"]["api_usd"])
    table = capsys.readouterr().out
    assert "Cost attribution" in table and "Abandoned streams" in table and "break-even" in table
    check_png(tmp_path / "plots" / "cost.png")


def test_tool_waits_and_system_prompt_from_multi_turn(fake_server, tmp_path, word_tokenizer):
    srv = fake_server(prefill_s=0.002, itl_s=0.002)
    out = tmp_path / "r.json"
    rc = run_cli(["bench", "serve", "--base-url", srv.url, "--quiet", "--dataset", "multi-turn", "--num-prompts", "2",
                  "--max-concurrency", "1", "--multi-turn-turns", "3", "--multi-turn-system-len", "30",
                  "--input-len", "5", "--multi-turn-tool-len", "3", "--output-len", "3",
                  "--multi-turn-think-time", "0.15", "--what-if-system-len", "10", "--save-result", str(out)],
                 tokenizer=word_tokenizer)
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["think_time_s"] for r in res["requests"]] == [0, 0.15, 0.15] * 2
    assert {r["system_tokens"] for r in res["requests"]} == {30}
    c = res["cost"]
    # one session at a time: nothing is in flight during a tool wait
    rows = {r["key"]: r for r in c["rows"]}
    assert rows["idle_tool_wait"]["seconds"] == pytest.approx(4 * 0.15, abs=1e-5)
    assert {r["key"]: r for r in c["session_time"]["rows"]}["tool_wait"]["seconds"] == pytest.approx(0.6)
    assert sum(r["seconds"] for r in c["rows"]) == pytest.approx(res["summary"]["duration_s"], rel=1e-9)
    assert [g["bucket"] for g in c["drivers"]["system_prompt"]] == ["30 tokens"]
    w = {x["key"]: x for x in c["what_if"]}["system_prompt"]
    assert w["prompt_tokens_cut"] == 6 * 20 and w["saving_uncached"]["usd"] is None


def test_sweep_prices_break_even_at_the_best_point(fake_server, tmp_path, capsys):
    srv = fake_server(capacity=2, prefill_s=0.005, itl_s=0.002)
    out = tmp_path / "s.json"
    rc = run_cli(["bench", "sweep", "--base-url", srv.url, "--concurrencies", "1,2", "--slo", "ttft:5000",
                  "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--cost-per-hour", "3.6",
                  "--api-price", "1,2", "--save-result", str(out), "--plot", str(tmp_path / "p"), "--quiet"])
    assert rc == 0
    sw = json.loads(out.read_text())["sweeps"][0]
    bp = sw["best_point"]
    a = bp["cost"]["api"]
    assert a["capacity_output_tok_s"] == pytest.approx(bp["output_token_throughput"])
    assert a["capacity_source"].startswith("the sweep's highest load within the SLO")
    assert bp["cost"]["money"]["usd_per_1m_output_tokens"] == pytest.approx(sw["cost_per_1m_output_tokens_usd"])
    assert all(p["cost"]["rows"] for p in sw["points"])
    assert "cost at the highest load within the SLO" in capsys.readouterr().out
    check_png(tmp_path / "p" / "sweep_cost.png")


def test_compare_cost_rows_for_bench_serve_compare():
    """``bench serve --compare``'s cost rows: tuples in CompareRow's order, from each side's
    ``cost`` section; USD with --cost-per-hour, else shares of the run; none without cost."""
    from pagedllm.benchmarks.compare import CompareRow, cost_rows, format_compare

    a = known_run()
    b = known_run()
    b["summary"]["duration_s"] = 200.0  # B: the same tokens in twice the time
    for r in b["requests"]:
        for k in ("scheduled_s", "start_s", "first_token_s", "end_s"):
            r[k] = None if r[k] is None else 2 * r[k]
    price = ApiPrice(1.0, 2.0)
    a["cost"] = ca = analyze(a, cost_per_hour=36.0, api_price=price)
    b["cost"] = cb = analyze(b, cost_per_hour=36.0, api_price=price)
    rows = {r[0]: r for r in compare_cost_rows(a, b)}
    assert list(rows) == ["$ per 1M output tokens", "Prompt compute saved by prefix cache",
                          "Cost of abandoned streams ($)", "Cost of retries ($)", "Break-even utilisation vs API"]
    assert all(len(r) == 5 for r in rows.values())
    usd = rows["$ per 1M output tokens"]
    assert usd[1:] == (pytest.approx(1e6 / 450), pytest.approx(2e6 / 450), ".4f", "lower")
    aborted = {r["key"]: r for r in ca["rows"]}["aborted"]
    assert rows["Cost of abandoned streams ($)"][1] == pytest.approx(aborted["usd"])
    assert rows["Cost of retries ($)"][1] == pytest.approx({r["key"]: r for r in ca["rows"]}["retried"]["usd"])
    assert rows["Prompt compute saved by prefix cache"][1] == \
        pytest.approx(ca["prefix_cache"]["share_of_prompt_compute_saved"])
    assert rows["Prompt compute saved by prefix cache"][4] == "higher"
    assert rows["Break-even utilisation vs API"][1:3] == (ca["api"]["break_even_utilisation"],
                                                          cb["api"]["break_even_utilisation"])
    # through compare.py's hook: B costs twice as much per token, so A is better
    crow = next(r for r in cost_rows(a, b) if r.name == "$ per 1M output tokens")
    assert isinstance(crow, CompareRow) and crow.ratio() == pytest.approx(2.0) and crow.winner() == "A"
    assert "Cost of retries ($)" in format_compare(cost_rows(a, b), ["a", "b"])

    # no --cost-per-hour: no $ rows; abandoned streams and retries as shares of the run
    a["cost"], b["cost"] = analyze(a), analyze(b)
    rows = {r[0]: r for r in compare_cost_rows(a, b)}
    assert list(rows) == ["Prompt compute saved by prefix cache", "Cost of abandoned streams (share of run)",
                          "Cost of retries (share of run)"]
    share = rows["Cost of abandoned streams (share of run)"]
    assert share[1] == pytest.approx({r["key"]: r for r in a["cost"]["rows"]}["aborted"]["time_share"])
    assert share[3] == ".2%"
    # a side without a cost section: no rows
    del b["cost"]
    assert compare_cost_rows(a, b) == [] and cost_rows(a, b) == []
