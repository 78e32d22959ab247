import argparse
import subprocess
import sys

import pytest
from bench_helpers import run_cli

from pagedllm.benchmarks import profile_summary, serve, sweep
from pagedllm.entrypoints.cli import build_parser


@pytest.mark.parametrize("argv,flag", [
    (["--goodput", "ttft=500"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--dataset", "sharegpt"], "--dataset-path"),
    (["--dataset", "trace", "--dataset-path", "/nonexistent.jsonl"], "--dataset-path"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--input-len", "0"], "--input-len"),
    (["--duration", "5"], "--max-concurrency"),
    (["--duration", "-1", "--request-rate", "2"], "--duration"),
    (["--base-url", "localhost:8000"], "--base-url"),
    (["--timeout", "0"], "--timeout"),
    (["--max-retries", "-1"], "--max-retries"),
    (["--dataset", "multi-turn", "--endpoint-type", "completions"], "multi-turn"),
])
def test_serve_bad_input_names_flag(argv, flag, capsys):
    rc = run_cli(["bench", "serve", *argv])
    assert rc == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--num-prompts", "x"], "--num-prompts"),
    (["--percentiles", "50,120"], "--percentiles"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--dataset", "nope"], "--dataset"),
])
def test_serve_argparse_errors_name_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as ei:
        run_cli(["bench", "serve", *argv])
    assert ei.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["--concurrencies", "4,2", "--slo", "ttft:1"], "--concurrencies"),
    (["--concurrencies", "1.5", "--slo", "ttft:1"], "--concurrencies"),
    (["--request-rates", "1,x", "--slo", "ttft:1"], "--request-rates"),
    (["--concurrencies", "1", "--slo", "ttft"], "--slo"),
    (["--concurrencies", "1", "--slo", "ttft:1", "--slo-percentile", "0"], "--slo-percentile"),
    (["--concurrencies", "1", "--slo", "ttft:1", "--cost-per-hour", "-2"], "--cost-per-hour"),
    (["--concurrencies", "1", "--slo", "ttft:1", "--compare", "http://x:1", "--labels", "a"], "--labels"),
    (["--concurrencies", "1", "--slo", "ttft:1", "--compare", "x:1"], "--compare"),
])
def test_sweep_bad_input_names_flag(argv, flag, capsys):
    assert run_cli(["bench", "sweep", *argv]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["throughput", "--backend", "hf", "-q", "int8"], "--quantization int8"),
    (["throughput", "--backend", "hf", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
    (["latency", "--backend", "hf", "llama.cpp", "-q", "gguf"], "--quantization gguf"),
    (["throughput", "--backend", "hf", "--attention-backend", "torch"], "--attention-backend torch"),
    (["throughput", "--backend", "hf", "--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["latency", "--backend", "hf", "--max-num-seqs", "4"], "--max-num-seqs 4"),
])
def test_engine_flags_without_a_pagedllm_engine_are_refused(argv, flag, capsys, monkeypatch):
    """HF alone would report its own unquantized figure under the flag's name; refused
    before any model loads."""
    from pagedllm.benchmarks import latency, throughput

    def ran(*a, **k):
        raise AssertionError("a backend ran")

    for mod in (latency, throughput):
        monkeypatch.setattr(mod, "run_hf", ran)
    monkeypatch.setattr(latency, "run_llama_cpp", ran)
    from pagedllm.entrypoints import cli

    assert cli.main(["bench", *argv, "--num-prompts" if argv[0] == "throughput" else "--batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "applies to pagedllm" in err, err


def test_sweep_requires_load_and_slo(capsys):
    with pytest.raises(SystemExit):
        run_cli(["bench", "sweep", "--slo", "ttft:1"])
    assert "--request-rates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli(["bench", "sweep", "--concurrencies", "1"])
    assert "--slo" in capsys.readouterr().err


def test_register_into_foreign_parser():
    # How pagedllm/entrypoints/cli.py wires us in, next to its own `bench throughput`.
    parser = argparse.ArgumentParser(prog="pagedllm")
    sub = parser.add_subparsers(dest="cmd")
    bench = sub.add_parser("bench").add_subparsers(dest="bench_cmd")
    serve.register(bench)
    sweep.register(bench)
    bench.add_parser("throughput").set_defaults(func=lambda a: 0)
    profile_summary.register(sub.add_parser("profile").add_subparsers(dest="profile_cmd"))
    a = parser.parse_args(["bench", "serve", "--num-prompts", "3", "--request-rate", "inf"])
    assert callable(a.func) and a.num_prompts == 3 and a.request_rate == float("inf")
    a = parser.parse_args(["bench", "sweep", "--concurrencies", "1,2", "--slo", "ttft:100", "tpot:20"])
    assert callable(a.func) and a.slo == ["ttft:100", "tpot:20"]
    a = parser.parse_args(["profile", "summarize", "/tmp/x"])
    assert callable(a.func) and a.dir == "/tmp/x"
    assert build_parser().parse_args(["bench", "serve"]).dataset == "random"


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--base-url", "--dataset", "--request-rate", "--burstiness", "--max-concurrency", "--goodput",
                 "--save-result", "--plot", "--max-retries", "--num-warmups", "--duration"):
        assert flag in out.stdout


def test_chat_or_text_prompts_from_ids_need_tokenizer(capsys):
    # checked before any request is sent; the server URL is never contacted
    assert run_cli(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                    "--endpoint-type", "chat"]) == 1
    assert "--tokenizer" in capsys.readouterr().err
    assert run_cli(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                    "--prompt-format", "text"]) == 1
    assert "--prompt-format text" in capsys.readouterr().err


def test_sweep_rejects_trace(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "prompt_len": 2, "output_len": 1}\n')
    assert run_cli(["bench", "sweep", "--dataset", "trace", "--dataset-path", str(p), "--concurrencies", "1",
                    "--slo", "ttft:1"]) == 2
    assert "--trace-speedup" in capsys.readouterr().err


def test_output_json_is_checked_before_the_benchmark_runs(tmp_path, monkeypatch, capsys):
    """A result file the run could not write is refused when the flags are parsed, before
    the run (minutes), naming the flag: a directory, or a path under a file."""
    from pagedllm.benchmarks import throughput
    from pagedllm.benchmarks.report import output_file
    from pagedllm.entrypoints import cli

    def run(*a, **k):
        raise AssertionError("the benchmark ran before --output-json was checked")

    monkeypatch.setattr(throughput, "throughput_main", run)
    (tmp_path / "f").write_text("")
    for bad, words in ((tmp_path, "is a directory"), (tmp_path / "f" / "r.json", "is a file, not a directory")):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "throughput", "--output-json", str(bad)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --output-json" in err and words in err, err
    new = str(tmp_path / "new" / "dir" / "r.json")
    assert output_file(new) == new    # parents to be made: fine


# -- the bench extra (aiohttp, matplotlib): optional, imported lazily ---------------------
def _without(monkeypatch, *packages):
    """Make ``import package`` fail as if it were not installed."""
    for name in packages:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("argv,missing", [
    (["bench", "serve"], "aiohttp"),
    (["bench", "serve", "--plot", "plots"], "matplotlib"),
    (["bench", "sweep", "--concurrencies", "1", "--slo", "ttft:1"], "aiohttp"),
    (["bench", "sweep", "--concurrencies", "1", "--slo", "ttft:1", "--plot", "plots"], "matplotlib"),
])
def test_load_generator_without_the_bench_extra_says_how_to_install_it(argv, missing, monkeypatch, capsys):
    _without(monkeypatch, missing)
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert f"needs {missing}, which is not installed: pip install 'pagedllm[bench]'" in err


def test_bench_server_without_aiohttp_stops_before_starting_a_server(monkeypatch, capsys):
    from pagedllm.benchmarks import server
    from pagedllm.entrypoints import cli

    _without(monkeypatch, "aiohttp")
    monkeypatch.setattr(server, "start_server", lambda *a, **k: pytest.fail("a server was started"))
    assert cli.main(["bench", "server", "--no-offline"]) == 2
    assert ("error: bench server needs aiohttp, which is not installed: pip install 'pagedllm[bench]'"
            in capsys.readouterr().err)


def test_bench_modules_and_the_cli_import_without_the_bench_extra():
    code = "\n".join([
        "import sys; sys.modules['aiohttp'] = sys.modules['matplotlib'] = None",
        "from pagedllm.benchmarks import client, plots, runner, serve, server, sweep",
        "from pagedllm.entrypoints.cli import build_parser; build_parser()",
        "from pagedllm.benchmarks.extras import MissingBenchPackageError",
        "try:",
        "    plots.plot_latency_cdfs({'requests': []}, 'unused.png')",
        "except MissingBenchPackageError as e:",
        "    print(e)"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "--plot needs matplotlib, which is not installed: pip install 'pagedllm[bench]'"


def test_the_bench_extra_is_optional_and_make_install_installs_it():
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "aiohttp" not in core and "matplotlib" not in core
    assert sorted(d.split(">")[0] for d in project["optional-dependencies"]["bench"]) == ["aiohttp", "matplotlib"]
    assert "pip install -q -e '.[test,bench,ray]'" in (root / "Makefile").read_text()
