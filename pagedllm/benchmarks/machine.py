"""What a benchmark ran on: the CPU's model name (as ``lscpu`` prints it), its ISA flags
that decide pagedllm's compute paths, core count and torch's thread count; the GPU's name."""
from __future__ import annotations

import os

import torch

from pagedllm.platform import cpu_features

# cpuinfo flags that select a compute path (AVX2 float32, AVX-512 / AMX bfloat16 and int8);
# each is a field of ``pagedllm.platform.CpuFeatures``
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def machine_info() -> dict:
    """``{"cpu", "isa" (flags of ISA_FLAGS present), "cores", "torch_threads", "torch"}``;
    unreadable fields are "unknown" (``isa`` then empty)."""
    cpu = cpu_features()
    return {"cpu": cpu.model_name, "isa": [f for f in ISA_FLAGS if getattr(cpu, f)], "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def device_info(device: torch.device) -> dict:
    """``{"device", "name"}`` of the device a benchmark ran on (a GPU's name, else the CPU's
    model name), plus ``memory_gib`` and ``multiprocessors`` on CUDA."""
    if device.type != "cuda":
        return {"device": str(device), "name": cpu_features().model_name}
    p = torch.cuda.get_device_properties(device)
    return {"device": str(device), "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count}
