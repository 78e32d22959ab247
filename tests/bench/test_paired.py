"""``pagedllm bench throughput --compare-args``: the second engine's flags parse over the
first's, the engines really take turns of the given length, and each one's tally counts
its own steps and tokens."""
from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.benchmarks.paired import compare_namespace, run_paired


def _args(**kw):
    from pagedllm.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["bench", "throughput"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_compare_flags_parse_over_the_first_engines():
    a = _args(dtype="float32", kv_cache_memory="64MiB")
    b = compare_namespace(a, "-q int8 --kv-cache-dtype fp8_e4m3")
    assert (b.quantization, b.kv_cache_dtype) == ("int8", "fp8_e4m3")
    assert (b.dtype, b.kv_cache_memory) == ("float32", "64MiB")     # kept from the first engine
    assert a.quantization is None and a.kv_cache_dtype == "auto"    # the first is untouched


@pytest.mark.parametrize("flags, words", [("", "empty"), ("--bogus 3", "not engine flags: --bogus 3"),
                                          ("--max-num-seqs many", "invalid"), ("-q", "expected one argument"),
                                          ("-q int4x", "--quantization: "),
                                          ("--max-num-seqs 0", "--max-num-seqs: must be a positive int"),
                                          ("'-q int8", "No closing quotation"),
                                          ("--num-threads 1", "--num-threads cannot differ"),
                                          ("--no-engine-process", "--engine-process cannot differ"),
                                          ("--profile-dir /tmp/p", "--profile-dir cannot differ")])
def test_bad_compare_flags_are_value_errors_naming_the_flag(flags, words):
    with pytest.raises(ValueError, match="--compare-args") as e:
        compare_namespace(_args(), flags)
    assert words in str(e.value)


@pytest.mark.slow   # ~5 s: two engines (fast-tier budget)
def test_engines_take_turns_and_tally_their_own_steps():
    from pagedllm import LLM, SamplingParams

    kw = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=128, engine_process=False)
    llms = [LLM(**kw), LLM(kv_cache_dtype="bfloat16", **kw)]
    calls = []
    for j, llm in enumerate(llms):
        step = llm.llm_engine.step

        def logged(*a, _j=j, _step=step, **k):
            calls.append(_j)
            return _step(*a, **k)
        llm.llm_engine.step = logged
    try:
        prompts = [[100 + i, 200 + i, 300 + i, 400, 500] for i in range(3)]
        sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        res = run_paired(llms, prompts, sp, rounds=2, interleave_steps=2)
    finally:
        for llm in llms:
            llm.shutdown()
    # one prefill step (all three prompts fit the token budget) then four decode steps
    # each; turns of two steps; the second round starts with the second engine
    assert calls == [0, 0, 1, 1, 0, 0, 1, 1, 0, 1] + [1, 1, 0, 0, 1, 1, 0, 0, 1, 0]
    assert len(res.rounds) == 2
    for r in res.rounds:
        for t in r:
            assert (t.steps, t.finished, t.output_tokens) == (5, 3, 15)
            assert t.seconds > 0 and t.output_tokens_per_s == pytest.approx(15 / t.seconds)
    assert res.ratios() == pytest.approx([r[1].output_tokens_per_s / r[0].output_tokens_per_s for r in res.rounds])
    total = res.total(1)
    assert (total.steps, total.output_tokens) == (10, 30)
    assert total.seconds == pytest.approx(sum(r[1].seconds for r in res.rounds))
    with pytest.raises(ValueError, match="two engines"):
        run_paired(llms[:1], prompts, sp, rounds=1, interleave_steps=1)


@pytest.mark.slow   # ~14 s: whole engines (fast-tier budget)
def test_throughput_cli_reports_each_round(tmp_path, capsys):
    from pagedllm.entrypoints.cli import build_parser

    out = tmp_path / "paired.json"
    args = build_parser().parse_args(
        ["bench", "throughput", "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--dtype", "float32",
         "--kv-cache-memory", "64MiB", "--max-model-len", "128", "--rounds", "2", "--interleave-steps", "3",
         "--compare-args=--kv-cache-dtype bfloat16", "--output-json", str(out)])
    assert args.func(args) == 0
    rep = json.loads(out.read_text())
    assert len(rep["rounds"]) == 2 and rep["interleave_steps"] == 3 and rep["machine"]["cpu"]
    assert "kv bfloat16" in rep["engines"][1] and "kv auto" in rep["engines"][0]
    for r in rep["rounds"]:
        assert r["ratio_b_over_a"] == pytest.approx(r["b_output_tokens_per_s"] / r["a_output_tokens_per_s"], rel=0.01)
    a_s = sum(r["a_step_s"] for r in rep["rounds"])
    assert rep["a_output_tokens_per_s"] == pytest.approx(2 * 2 * 4 / a_s, rel=0.02)
    assert "B/A" in capsys.readouterr().out
    bad = build_parser().parse_args(["bench", "throughput", "--backend", "hf", "--compare-args=-q int8"])
    with pytest.raises(ValueError, match="--backend pagedllm"):
        bad.func(bad)


def test_the_cli_takes_the_flags_after_a_space_and_checks_them_before_loading(monkeypatch, capsys):
    """``--compare-args "-q int4x"`` (a space, not "="): argparse alone would read "-q int4x"
    as a flag; the CLI attaches it, and both engines' flags are checked before any loads."""
    import pagedllm
    from pagedllm.entrypoints import cli

    def load(*a, **k):
        raise AssertionError("an engine loaded before the flags were checked")

    monkeypatch.setattr(pagedllm, "LLM", load)
    assert cli.main(["bench", "throughput", "--compare-args", "-q int4x"]) == 2
    assert "--compare-args '-q int4x': --quantization: " in capsys.readouterr().err
    assert cli.main(["bench", "throughput", "--max-num-seqs", "0", "--compare-args", "-q int8"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs: must be a positive int" in err and "--compare-args" not in err   # the first engine's


@pytest.mark.slow   # ~11 s: whole engines (fast-tier budget)
def test_an_engine_that_fails_is_named_and_profiling_is_refused(capsys):
    """An engine that cannot load, or cannot take the prompts, is named in the error (the
    command's engine or --compare-args's); --profile-dir is refused before anything loads."""
    from pagedllm.entrypoints import cli

    base = ["bench", "throughput", "--num-prompts", "2", "--input-len", "16", "--output-len", "2", "--dtype",
            "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "64"]
    assert cli.main([*base, "--profile-dir", "/tmp/never", "--compare-args=-q int8"]) == 2
    assert "--profile-dir cannot be used with --compare-args" in capsys.readouterr().err
    assert cli.main([*base, "--compare-args=--model /nonexistent/m.gguf"]) == 2
    assert "--compare-args '--model /nonexistent/m.gguf' (B): " in capsys.readouterr().err
    assert cli.main([*base, "--compare-args=--max-model-len 8"]) == 2
    err = capsys.readouterr().err
    assert "--compare-args '--max-model-len 8' (B): " in err and "max_model_len" in err, err
