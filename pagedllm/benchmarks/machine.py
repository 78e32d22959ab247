"""What a benchmark ran on: the CPU's model name (as ``lscpu`` prints it), its ISA flags
that decide pagedllm's compute paths, core count and torch's thread count."""
from __future__ import annotations

import os

import torch

# cpuinfo flags that select a compute path (AVX2 float32, AVX-512 / AMX bfloat16 and int8)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def machine_info() -> dict:
    """``{"cpu": model name, "isa": [flags from ISA_FLAGS present], "cores": os.cpu_count(),
    "torch_threads": ..., "torch": version}``; fields that cannot be read are "unknown"."""
    cpu, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "unknown":
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": cpu, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
