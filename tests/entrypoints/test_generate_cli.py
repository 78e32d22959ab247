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
    (["--max-model-len", "0"], "--max-model-len: must be a positive int"),
    (["--block-size", "0"], "--block-size: must be a positive int"),
    (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization: must be in (0, 1]"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory: "),
    (["--attention-backend", "nope"], "--attention-backend: unknown attention backend 'nope'"),
    (["-q", "int4x"], "--quantization: "),
])
def test_bad_flag_rejected_before_loading(no_model_load, capsys, argv, flag):
    assert cli.main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count(flag) == 1, err


def test_empty_prompt_rejected_before_loading(no_model_load, capsys):
    assert cli.main(["generate", ""]) == 2
    assert "PROMPT" in capsys.readouterr().err


@pytest.fixture
def no_tokenizer_or_weights(monkeypatch):
    """LLM may read the model's config, but neither its tokenizer nor its weights."""
    from pagedllm.engine import llm_engine
    from pagedllm.models import loader

    def load(*args, **kwargs):
        raise AssertionError("the tokenizer or weights were loaded before the flags were checked")

    monkeypatch.setattr(llm_engine, "get_tokenizer", load)
    monkeypatch.setattr(loader, "build_model", load)


def test_max_model_len_over_model_context_rejected(no_tokenizer_or_weights, capsys, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert cli.main(["generate", "hello", "--max-model-len", "20000"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len: 20000 is longer" in err and "8192" in err, err


def test_cuda_device_without_cuda_rejected(no_tokenizer_or_weights, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["generate", "hello", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "CUDA is not available" in err, err


def test_serve_on_busy_port_fails_before_loading(capsys, monkeypatch):
    import socket

    from pagedllm.entrypoints.openai import api_server

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(api_server, "AsyncLLM", load)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err, err


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "--port must be in 0-65535"), (["--port", "-1"], "--port must be in 0-65535"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a finite"),
])
def test_serve_flags_checked_before_loading(monkeypatch, capsys, argv, words):
    from pagedllm.entrypoints.openai import api_server

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(api_server, "AsyncLLM", load)
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("device", ["meta", "xpu"])
def test_device_other_than_cpu_or_cuda_rejected(no_tokenizer_or_weights, capsys, device):
    assert cli.main(["generate", "hello", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device: ") and "runs on cpu or cuda" in err, err
