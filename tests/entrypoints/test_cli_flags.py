"""The ``pagedllm`` command's own flags: log levels checked before anything runs, and
``serve``'s vLLM spellings (the model as a positional argument, ``--kv-cache-memory-bytes``)."""
from __future__ import annotations

import logging

import pytest

from pagedllm import envs
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai import api_server


@pytest.fixture
def served(monkeypatch):
    """run_server replaced: records the parsed args instead of loading a model."""
    seen = []
    monkeypatch.setattr(api_server, "run_server", seen.append)
    return seen


@pytest.mark.parametrize("argv, named", [
    (["--log-level", "foo", "models"], "--log-level"),
    (["--log-level", "basicConfig", "models"], "--log-level"),   # a logging attribute, not a level
    (["serve", "--uvicorn-log-level", "bogus"], "--uvicorn-log-level"),
])
def test_bad_log_level_flags_exit_2_naming_the_flag(served, capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert served == []


def test_bad_log_level_variable_exits_2_naming_it(served, capsys, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_LOG_LEVEL", "foo")
    with pytest.raises(SystemExit) as e:
        cli.main(["serve"])
    assert e.value.code == 2 and "PAGEDLLM_LOG_LEVEL" in capsys.readouterr().err
    assert served == []
    with pytest.raises(ValueError, match="PAGEDLLM_LOG_LEVEL"):
        envs.log_level()


def test_log_levels_in_any_case(served, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_LOG_LEVEL", "debug")
    assert envs.log_level() == "DEBUG"
    monkeypatch.setenv("PAGEDLLM_LOG_LEVEL", "warn")    # logging's own other names
    assert envs.log_level() == "WARNING"
    monkeypatch.setenv("PAGEDLLM_LOG_LEVEL", "Fatal")
    assert envs.log_level() == "CRITICAL"
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)   # leave pytest's logging alone
    assert cli.main(["--log-level", "Warning", "serve", "--uvicorn-log-level", "INFO"]) == 0
    assert served[0].log_level == "WARNING" and served[0].uvicorn_log_level == "info"


def test_serve_takes_the_model_positionally_as_vllm_does(served, capsys, tmp_path):
    path = str(tmp_path / "m.gguf")
    assert cli.main(["serve", path, "--kv-cache-memory-bytes", "1GiB"]) == 0
    assert served[0].model == path and served[0].kv_cache_memory == "1GiB"
    assert cli.main(["serve", "--model", path]) == 0 and served[1].model == path
    assert cli.main(["serve", path, "--model", path]) == 0 and served[2].model == path
    assert cli.main(["serve", path, "--model", path + "x"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert len(served) == 3
