# Two commands on a fresh machine: `make serve` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# The CPU torch build first: PyPI's torch is the CUDA build (several GB of CUDA packages).
# PyTorch's CPU index has the CPU build; where it cannot be reached (a machine with its own
# wheel directory, as ours), pip takes torch from where it is configured to look.
# A GPU host: make setup TORCH_INDEX= (PyPI's CUDA build).
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup genai-perf serve demo test check lint bench rehearsal
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	if [ -n "$(TORCH_INDEX)" ] && $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=5)" 2>/dev/null; \
	then echo "torch: the CPU build from $(TORCH_INDEX)"; $(PIP) "$(TORCH)" --index-url "$(TORCH_INDEX)" 2>&1 | grep -v "^WARNING: Location" || true; \
	else echo "torch: $(TORCH_INDEX) unreachable or not asked for: $(TORCH) from pip's own index"; $(PIP) "$(TORCH)" 2>&1 | grep -v "^WARNING: Location" || true; fi
	$(PIP) -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, transformers, tritonclient, preble_backend; print('torch', torch.__version__, 'CUDA' if torch.version.cuda else 'CPU', 'build')"
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
	$(VENV)/bin/ruff format --check .

# The quick loop: lint, then every test that starts no tritonserver (12 minutes on the
# project's 2-core machine, 2026-11-30). `make test` is the full suite and CI's command.
check: lint
	$(PY) -m pytest -q -p no:cacheprovider -m "not server"

bench: setup
	$(PY) -m preble_backend.benchmarks.prefix_cache

# The device script's stack step on this CPU, in a virtual environment with the device
# image's versions (numpy 2, its torch and triton; kernels/rehearsal.py): run it before
# spending a lent GPU's minutes.
rehearsal: setup
	$(PY) -m kernels.rehearsal
