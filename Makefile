# The two set-up commands of the README:
#   make demo   create .venv, install oncely, run `oncely demo` on the embedded SQLite default
#   make test   install the dev extras, check generated code, lint, type-check, run every test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck generate bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[sqlite,cli]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed-demo

$(VENV)/.installed-bench: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $@

demo: $(VENV)/.installed-demo
	$(VENV)/bin/oncely demo $(DEMO_ARGS)

generate: $(VENV)/.installed-dev
	$(PY) tools/unasync.py

lint: $(VENV)/.installed-dev
	$(PY) tools/unasync.py --check
	$(VENV)/bin/ruff check src tools tests bench examples
	$(VENV)/bin/ruff format --check src tools

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed-bench
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist src/*.egg-info
