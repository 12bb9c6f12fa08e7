# Two commands on a fresh machine: `make serve` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# The CPU torch build first: an unpinned torch would pull several GB of CUDA packages.
TORCH ?= torch==2.13.0

.PHONY: setup genai-perf serve demo test lint bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) "$(TORCH)" 2>&1 | grep -v "^WARNING: Location" || true
	$(PIP) -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, transformers, tritonclient, preble_backend"
	$(PY) -m client.perf_analyzer --link-libraries
	touch $@

# genai-perf in a venv of its own: it needs numpy 2 and transformers 5, the Triton stubs
# numpy < 2. It drives the main venv's perf_analyzer (on PATH when it runs).
GENAI_PERF ?= .venv-genai-perf
genai-perf: $(GENAI_PERF)/.installed

$(GENAI_PERF)/.installed:
	python3 -m venv $(GENAI_PERF)
	$(GENAI_PERF)/bin/python -m pip install -q --disable-pip-version-check "genai-perf==0.0.16" 2>&1 | grep -v "^WARNING: Location" || true
	$(GENAI_PERF)/bin/genai-perf --version
	touch $@

# Options go through: make serve SERVE_ARGS="--http-port 9000 --grpc-port 9001 --metrics-port 9002"
SERVE_ARGS ?=
serve: setup
	$(VENV)/bin/preble serve $(SERVE_ARGS)

test: setup genai-perf
	$(PY) -m pytest -q -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m preble_backend.engine.bench_prefix_cache
