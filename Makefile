# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv and install mhagen with its test and tuning extras on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-arm setup-arm venv clean gpu-bundle

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,tune]'
	touch $(STAMP)

venv: $(STAMP)

# Build the default layer (d_model 512, 8 heads) for this machine, check it, time it.
demo: $(STAMP)
	$(BIN)/mhagen build --d-model 512 --heads 8 --batch 1 --seq-len 128 --out build/mha-512x8

# The tests include aarch64 builds run under qemu: setup-arm installs the cross toolchain and
# qemu-user with apt (skipped when present).
test: $(STAMP) setup-arm
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

setup-arm:
	.ci/setup-arm.sh

test-arm: $(STAMP) setup-arm
	$(BIN)/python -m pytest -q tests/test_arm.py

# CUDA artifacts, inputs and references for a GPU machine (then: gpu_bundle/gpu_check.sh run).
gpu-bundle: $(STAMP)
	scripts/gpu_check.sh prepare gpu_bundle

clean:
	rm -rf build gpu_bundle .pytest_cache
