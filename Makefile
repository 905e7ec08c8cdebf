# The two set-up commands of the README:
#   make demo   create .venv, install oncely, run `oncely demo` on the embedded SQLite default
#   make test   install the dev extras, check generated code, lint, type-check, run every test
# PYTHON: the interpreter that creates the venv, 3.11 or newer (make demo PYTHON=python3.12).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?=
PYTEST_ARGS ?=
# The oldest Python oncely runs on (pyproject.toml's requires-python).
MIN_PYTHON := 3.11
# Exits 1 with a message naming the interpreter when it is older than MIN_PYTHON.
CHECK_PYTHON = -c 'import sys; want = tuple(map(int, "$(MIN_PYTHON)".split("."))); \
	sys.exit(0 if sys.version_info >= want else "oncely needs Python $(MIN_PYTHON) or newer; " \
	f"{sys.executable} is {sys.version.split()[0]}")'

# make smoke: a short run on another Python than the venv's, in a venv of its own (CI runs it
# on the newest Python the classifiers list): the generated code, the core, the SQLite store,
# and the contract tests on SQLite, memory and PostgreSQL. Skipped, saying why, when there is
# no such interpreter.
SMOKE_PYTHON ?= python3.13
SMOKE_VENV ?= .venv-smoke
SMOKE_PY := $(SMOKE_VENV)/bin/python

.PHONY: demo test lint typecheck generate bench clean smoke

# The version is checked before the venv is made: pip would fail on an older Python only
# after the venv exists, and every later make would reuse that broken venv.
$(VENV)/bin/python:
	@$(PYTHON) $(CHECK_PYTHON) || { echo "choose a Python $(MIN_PYTHON)+ interpreter: \
	make $(or $(MAKECMDGOALS),demo) PYTHON=python$(MIN_PYTHON)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# A venv an older oncely or Python left behind is refused with the way out.
define check_venv
	@$(PY) $(CHECK_PYTHON) || { echo "$(VENV) was made with that Python: make clean, then \
	make $(or $(MAKECMDGOALS),demo) PYTHON=python$(MIN_PYTHON)" >&2; exit 1; }
endef

$(VENV)/.installed-demo: pyproject.toml | $(VENV)/bin/python
	$(check_venv)
	$(PY) -m pip install --quiet -e '.[sqlite,cli]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(VENV)/bin/python
	$(check_venv)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed-demo

$(VENV)/.installed-bench: pyproject.toml | $(VENV)/bin/python
	$(check_venv)
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

smoke:
	@$(SMOKE_PYTHON) -c '' 2>/dev/null || { echo "make smoke: skipped, $(SMOKE_PYTHON) \
	does not run here; name one with make smoke SMOKE_PYTHON=/path/to/python3.13"; exit 0; }; \
	set -e; \
	$(SMOKE_PYTHON) $(CHECK_PYTHON); \
	version='import sys; print(sys.version)'; \
	if [ "$$($(SMOKE_PY) -c "$$version" 2>/dev/null)" != "$$($(SMOKE_PYTHON) -c "$$version")" ]; \
	then $(SMOKE_PYTHON) -m venv --clear $(SMOKE_VENV); fi; \
	echo "make smoke: $$($(SMOKE_PY) -c 'import sys; print(sys.version.split()[0])') in $(SMOKE_VENV)"; \
	$(SMOKE_PY) -m pip install --quiet --upgrade pip; \
	$(SMOKE_PY) -m pip install --quiet -e '.[dev]'; \
	$(SMOKE_PY) tools/unasync.py --check; \
	$(SMOKE_VENV)/bin/pytest -q tests/core tests/test_unasync.py tests/test_sqlite_store.py; \
	$(SMOKE_VENV)/bin/pytest -q tests/contract -k "sqlite or memory or postgres"

clean:
	rm -rf $(VENV) $(SMOKE_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist src/*.egg-info
