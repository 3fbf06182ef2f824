# Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/default
# A packaged config's name (primal_dual/configs/<name>.py) or a config file's path.
CONFIG ?= default

.PHONY: install dist install-gpu-dev test-fast test-durations gpu-compile device-suite lint test test-soak train eval bench reproduce-uea reproduce-listops reproduce-images reproduce-sraven reproduce-logic clean clean-data

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $(STAMP)

install: $(STAMP)

# The package as one wheel (dist/primal_dual-<version>-py3-none-any.whl, pure Python, no
# dependencies bundled): what the notebook's first cell installs in a runtime without a clone
# (Colab: upload it, or serve it at an https:// address; notebooks/quickstart.ipynb).
dist: $(STAMP)
	rm -rf build  # setuptools keeps build/lib between builds: a removed module would ship
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .
	rm -rf build
	@ls dist/*.whl

# The [gpu-dev] extra (triton, torch, jax-triton): the sm_90a compile report and tests, and the
# fused Triton HYLA kernels run by Triton's interpreter in the test suite. torch 2.13.0 is pinned:
# where a CPU build of it lies in pip's find-links (as on the CI machines) pip takes that one.
GPU_DEV_STAMP := $(VENV)/.installed-gpu-dev
$(GPU_DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[gpu-dev]" "torch==2.13.0"
	touch $(GPU_DEV_STAMP)

install-gpu-dev: $(GPU_DEV_STAMP)

# The formatter and the pyflakes checks (pyproject [tool.ruff]); `ruff format .` fixes the first.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: $(GPU_DEV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The fast tier: every test measured under 1 s (tests/durations.json; tests/conftest.py marks the
# rest slow), in a couple of minutes. It needs no [gpu-dev] extra: what needs one skips, saying so.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

# Re-measures tests/durations.json (what the fast tier leaves out): the whole suite, idle machine.
test-durations: $(GPU_DEV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --record-durations=tests/durations.json tests

# Every property test (the files with @given) at 50x its examples, freshly drawn, and nothing else
# (tests/conftest.py, profile 'soak'); CI's 'ci' profile is derandomized and never draws new ones.
PROPERTY_TESTS = $(shell grep -lE "^ *@(hypothesis\.)?given" tests/test_*.py)
test-soak: $(GPU_DEV_STAMP)
	HYPOTHESIS_PROFILE=soak $(PY) -m pytest -q -n 2 --dist loadfile $(PROPERTY_TESTS)

train: $(STAMP)
	$(PY) train.py --config=$(CONFIG) --workdir=$(WORKDIR)

eval: $(STAMP)
	$(PY) eval.py --workdir=$(WORKDIR)

# Speed, memory and FLOPs of every kernel, and training throughput (writes benchmarks/results/).
bench: $(STAMP)
	$(PY) -m benchmarks.attention --out-dir benchmarks/results
	$(PY) -m benchmarks.train_throughput --out-dir benchmarks/results

# Registers, spills, shared memory and matrix instructions of the GPU kernels (the fused Triton
# 'tensorcore' HYLA) compiled for sm_90a, without a GPU (benchmarks/results/
# gpu_compile.{json,md}; each ptxas capped in memory and time). One family or tile, e.g.:
# make gpu-compile GPU_COMPILE_FLAGS="--families tensorcore --tiles 16"
gpu-compile: $(GPU_DEV_STAMP)
	$(PY) -m tools.device.gpu_compile --out-dir benchmarks/results $(GPU_COMPILE_FLAGS)

# Every GPU figure the targets read, within 8 minutes of one GPU (benchmarks/README.md says how to
# run it through a lent device): benchmarks/results/device_suite_<label>.{json,md}.
device-suite: $(STAMP)
	$(PY) -m benchmarks.device_suite --budget-s 480 --out-dir benchmarks/results

# Paper reproductions (resume where they stopped; write results/*.json|md).
# Runs trained at once by the reproduce-* grids (one process each; e.g. JOBS=11 on a GPU).
JOBS ?= 1
# The published grid by default; e.g. UEA_SCALE=reference UEA_EPOCHS=-1 for the protocol's.
UEA_SCALE ?= small
UEA_EPOCHS ?= 40
reproduce-uea: $(STAMP)
	$(PY) scripts/reproduce.py uea --scale=$(UEA_SCALE) --epochs=$(UEA_EPOCHS) --jobs=$(JOBS)

reproduce-listops: $(STAMP)
	$(PY) scripts/reproduce.py listops --jobs=$(JOBS)

reproduce-images: $(STAMP)
	$(PY) scripts/reproduce.py images --jobs=$(JOBS)

reproduce-sraven: $(STAMP)
	$(PY) scripts/reproduce.py sraven --jobs=$(JOBS)

reproduce-logic: $(STAMP)
	$(PY) scripts/reproduce.py logic --jobs=$(JOBS)

# Prepared data sets (TFDS array_record) live in $TFDS_DATA_DIR or ~/tensorflow_datasets and are
# shared by every checkout and environment: `clean` keeps them, `clean-data` removes ours.
TFDS_DATA ?= $(or $(TFDS_DATA_DIR),$(HOME)/tensorflow_datasets)
clean:
	rm -rf workdirs .pytest_cache .hypothesis
	@echo "prepared data sets in $(TFDS_DATA) kept; 'make clean-data' removes them (no job may be using them)"

clean-data:
	rm -rf $(TFDS_DATA)/uea_multivariate $(TFDS_DATA)/listops
