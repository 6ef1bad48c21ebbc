# The torch pin lives here only: it installs the CPU wheel that lies on the build machines' disk before the project,
# so that pyproject's torch>= range is already met and pip never pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DS_EXTENSIONS := $(CURDIR)/$(VENV)/torch_extensions

.PHONY: setup test lint typecheck unit demo bench dashboards alerts gpu-check clean

setup: $(VENV)/.installed

# DeepSpeed compiles its CPU shared-memory op (g++, ninja) at its first init_distributed: once here, into the venv
# (a build killed half-way leaves a lock that would hang every later run in a shared cache).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev,ops,lightning,transformers,postgres,torchtitan,deepspeed,megatron]'
	rm -rf $(DS_EXTENSIONS)
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(DS_EXTENSIONS) $(PY) -c \
		"from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

lint: setup
	$(VENV)/bin/ruff check sdc_telemetry tests benchmarks examples scripts

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	TORCH_EXTENSIONS_DIR=$(DS_EXTENSIONS) $(PY) -m pytest tests --durations=40

demo: setup
	$(VENV)/bin/sdc-telemetry demo

bench: setup
	$(PY) benchmarks/fingerprint.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/overhead_parts.py
	$(PY) benchmarks/audit.py
	$(PY) benchmarks/scale.py
	$(PY) benchmarks/hsdp.py
	$(PY) benchmarks/nd.py
	$(PY) benchmarks/nd.py --campaign
	$(PY) benchmarks/campaign.py
	$(PY) benchmarks/campaign.py --mode tolerance --kernel-deviation --sweep --trials 60 --healthy 240
	$(PY) benchmarks/campaign.py --mode tolerance --kernel-deviation --sweep --trials 60 --healthy 240 --precision bf16
	$(PY) benchmarks/launches.py
	$(PY) benchmarks/prometheus_scale.py

dashboards: setup
	$(VENV)/bin/sdc-telemetry dashboards

alerts: setup
	$(VENV)/bin/sdc-telemetry alerts

gpu-check: setup
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
