# Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/default
CONFIG ?= configs/default.py

.PHONY: install test train eval bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

train: $(STAMP)
	$(PY) train.py --config=$(CONFIG) --workdir=$(WORKDIR)

eval: $(STAMP)
	$(PY) eval.py --workdir=$(WORKDIR)

clean:
	rm -rf workdirs .pytest_cache .hypothesis
