#!/usr/bin/env bash
# The GPU check (docs/gpu.md), on a machine with one NVIDIA GPU and no network:
#   scripts/gpu_check.sh [gpu_check.py flags]        # from anywhere; JSON to $OUT/gpu_check.json
# Installs the wheels `make gpu-wheels` put in .gpu-wheels/ into $GPU_CHECK_SITE (never into
# a venv), puts the repo and that folder on PYTHONPATH (no install, no C++ CPU kernel
# build: PAGEDLLM_CPU_KERNELS=0), and runs scripts/gpu_check.py under a hard time limit.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/pagedllm-gpu-check-site}
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .gpu-wheels/*.whl || echo "gpu_check.sh: installing .gpu-wheels failed; going on" >&2
else
    echo "gpu_check.sh: no .gpu-wheels/*.whl (run 'make gpu-wheels' and carry .gpu-wheels)" >&2
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PAGEDLLM_CPU_KERNELS=0
# the driver keeps to --budget-s (450 s by default); this limit only catches a driver that hangs
timeout -k 10 "${GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu_check.py "$@"
