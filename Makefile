# One command checks everything: `make check`. CI runs scripts/test.sh, which builds the
# virtual environment and then runs `make check` inside it.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: check fmt lint types contracts test test-fast bench demo

check: fmt lint types contracts test

fmt:
	ruff format --check src tests bench

lint:
	ruff check src tests bench

types:
	mypy

contracts:
	lint-imports

# --durations: the slowest tests' times stay in the CI log, to keep the fast lane honest.
test:
	python -m pytest -q --durations=30

# The developer's loop: the unit and single-process suites, without the tests marked slow,
# those that run LMCache, Dynamo, a browser or Kafka, and the suites that start whole
# fleets of processes (differential, upgrade, deploy, evaluation, attack) or check the
# docs' commands. `make check` stays the complete run that CI does.
# Two worker processes (pytest-xdist), each test file whole in one of them: a file's
# module fixtures (the servers and models its tests share) are built once, and the tests
# that must not overlap across files take a lock of their own (tests/coordinator/conftest.py).
FAST_SKIP := --ignore=tests/differential --ignore=tests/upgrade --ignore=tests/deploy \
	--ignore=tests/evaluation --ignore=tests/attack --ignore=tests/docs
FAST_WORKERS ?= 2
test-fast:
	python -m pytest -q -n $(FAST_WORKERS) --dist loadfile \
		-m "not slow and not lmcache and not dynamo and not browser and not kafka" \
		$(FAST_SKIP) --durations=10

bench:
	python -m bench.run_all

demo:
	kvatlas demo
