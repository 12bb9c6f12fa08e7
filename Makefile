# Two commands on a fresh machine: `make serve` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# The CPU torch build first: an unpinned torch would pull several GB of CUDA packages.
TORCH ?= torch==2.13.0

.PHONY: setup serve demo test lint bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) "$(TORCH)" 2>&1 | grep -v "^WARNING: Location" || true
	$(PIP) -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, transformers, tritonclient, preble_backend"
	$(PY) -m client.perf_analyzer --link-libraries
	touch $@

# Options go through: make serve SERVE_ARGS="--http-port 9000 --grpc-port 9001 --metrics-port 9002"
SERVE_ARGS ?=
serve: setup
	$(VENV)/bin/preble serve $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m preble_backend.engine.bench_prefix_cache
