# The two commands of the README: `make run` and `make test`. Both install everything from nothing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install system-deps run test test-slow test-faults lint bench clean postgres

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and by exact version: on the CPU machines this takes the CPU wheel on disk,
	# never a CUDA build. On a GPU cluster install a CUDA build of torch==2.13.0 before `make`.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[server,dev]'
	touch $(STAMP)

install: $(STAMP) system-deps

# Tools the tests use from Debian: promtool (prometheus), docker-compose (compose validation).
system-deps:
	@command -v promtool >/dev/null 2>&1 && command -v docker-compose >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq >/dev/null 2>&1 || true); \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus docker-compose >/dev/null; \
	  else echo "install Debian's 'prometheus' and 'docker-compose' packages for the deploy tests"; fi; }

postgres:
	@pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1 || \
	  pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start || true

run: install
	$(BIN)/python -m service.demo

test: install postgres
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-slow: install postgres
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

test-faults: install postgres
	$(BIN)/python -m pytest -q -m slow tests/faults $(PYTEST_ARGS)

# Benchmarks print Lattice against its peers measured in the same run (see docs/benchmarks.md).
bench: install
	$(BIN)/python -m pip install -q -e '.[server,dev,bench]'
	$(BIN)/python -m bench.planner
	$(BIN)/python -m bench.api --rates 50,100,200,400 --duration 10
	$(BIN)/python -m bench.ddp
	$(BIN)/python -m bench.zero
	$(BIN)/python -m bench.pipeline
	$(BIN)/python -m bench.cp
	$(BIN)/python -m bench.overhead
	$(BIN)/python -m bench.recovery
	$(BIN)/python -m bench.elastic
	$(BIN)/python -m bench.sdc
	$(BIN)/python -m bench.planner_accuracy
	$(BIN)/python -m bench.cluster_sim
	$(BIN)/python -m bench.failover

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .lattice .pytest_cache
