"""Default logging (``pagedllm/logger.py``): a program that configures no logging sees the
engine's INFO lines once on stderr; one that configures logging, before or after the engine
starts, sees each line once, through its own handlers, at its own levels. Each case runs in
a fresh interpreter (pytest's own handlers on the root logger would hide the default)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(code: str, **env) -> str:
    """stderr of ``python -c code`` with ``env`` added (offline, the project importable)."""
    full = {k: v for k, v in os.environ.items() if k not in ("PAGEDLLM_LOG_LEVEL", "PAGEDLLM_CONFIGURE_LOGGING")}
    full.update(HF_HUB_OFFLINE="1", **env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


DEFAULT = ("import logging\nfrom pagedllm.logger import configure_default_logging\n"
           "configure_default_logging()\nlog = logging.getLogger('pagedllm')\n")


def test_no_configuration_prints_info_once():
    err = _run(DEFAULT + "log.info('hello %d', 7)\nlog.debug('hidden')\nconfigure_default_logging()\nlog.info('again')")
    lines = err.splitlines()
    assert [line.split(" ", 2)[0] for line in lines] == ["INFO", "INFO"]
    assert lines[0].endswith("pagedllm: hello 7") and lines[1].endswith("pagedllm: again")


def test_level_and_switch_from_the_environment():
    warned = _run(DEFAULT + "log.info('hello')\nlog.warning('warned')", PAGEDLLM_LOG_LEVEL="WARNING").splitlines()
    assert len(warned) == 1 and warned[0].startswith("WARNING") and warned[0].endswith("pagedllm: warned")
    assert "hello" not in _run(DEFAULT + "log.info('hello')", PAGEDLLM_CONFIGURE_LOGGING="0")
    debug = _run(DEFAULT + "log.debug('deep')", PAGEDLLM_LOG_LEVEL="DEBUG")
    assert debug.startswith("DEBUG") and debug.rstrip().endswith("pagedllm: deep")


def test_application_logging_configured_before_is_left_alone():
    """basicConfig first: its format, its WARNING level, each line once."""
    err = _run("import logging\nlogging.basicConfig(format='APP %(levelname)s %(message)s')\n" + DEFAULT
               + "log.info('not shown')\nlog.warning('shown')")
    assert err.splitlines() == ["APP WARNING shown"]


def test_application_logging_configured_after_takes_over():
    """basicConfig after the engine's default: the default handler falls silent, so each
    line comes once, in the application's format."""
    err = _run(DEFAULT + "log.info('before')\nlogging.basicConfig(format='APP %(message)s')\nlog.info('after')")
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].endswith("pagedllm: before") and lines[1] == "APP after"


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True])
def test_offline_llm_prints_its_start_up_lines(engine_process):
    """``LLM()`` in a script without logging set up: the start-up lines (dtype, what each
    layer runs, the KV cache) on stderr, once each, from the front end and the engine core."""
    err = _run("from pagedllm import LLM\n"
               f"llm = LLM(max_model_len=256, kv_cache_memory='32MiB', engine_process={engine_process})\n"
               "llm.shutdown()")
    loaded = [line for line in err.splitlines() if " loaded SmolLM2-135M-Instruct" in line]
    assert len(loaded) == 1 and loaded[0].startswith("INFO"), err
    assert sum("KV cache: " in line for line in err.splitlines()) == 1, err
