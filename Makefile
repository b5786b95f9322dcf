# One command checks everything: `make check`. CI runs scripts/test.sh, which builds the
# virtual environment and then runs `make check` inside it.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: check fmt lint types contracts test bench demo

check: fmt lint types contracts test

fmt:
	ruff format --check src tests bench

lint:
	ruff check src tests bench

types:
	mypy

contracts:
	lint-imports

test:
	python -m pytest -q

bench:
	python -m bench.run_all

demo:
	kvatlas demo
