"""``pagedllm generate`` rejects bad sampling flags before it loads the model, naming the flag."""
from __future__ import annotations

import pytest

import pagedllm
from pagedllm.entrypoints import cli


@pytest.fixture
def no_model_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(pagedllm, "LLM", load)


@pytest.mark.parametrize("argv,flag", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", "-3"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--seed-sampling", str(2**63)], "--seed-sampling"),
    (["--max-model-len", "0"], "max_model_len"),
])
def test_bad_flag_rejected_before_loading(no_model_load, capsys, argv, flag):
    assert cli.main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err, err


def test_empty_prompt_rejected_before_loading(no_model_load, capsys):
    assert cli.main(["generate", ""]) == 2
    assert "PROMPT" in capsys.readouterr().err
