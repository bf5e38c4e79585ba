# `make run`: set up what running needs and start the server with data in ./data;
#   ARGS go to `headwater serve`, e.g. make run ARGS="--listen http=127.0.0.1:8080".
# `make test`: set up with test extras, lint, type-check and run every test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The plain install (no test or Spark extras), which is all `make run` needs; the full
# install above includes it.
RUN_STAMP := $(VENV)/.installed-run
ARGS ?=

.PHONY: run test lint typecheck pytest bench clean system-deps rivven-proto cluster

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,spark]'
	touch $(STAMP) $(RUN_STAMP)

$(RUN_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/headwater serve --data-dir ./data $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# The dashboard and WebSocket browser tests drive Debian's headless chromium, the
# postgres listener's tests Debian's psql, the Prometheus tests promtool (Debian's
# prometheus package), the systemd unit's test systemd-analyze (Debian's systemd; no
# running systemd needed) and the kafka listener's tests Debian's kcat (librdkafka
# 2.0.2, the oldest client it serves), the cluster's tests and `make cluster` Debian's
# etcd-server, the Spark tests a JDK and the postgres listener's JDBC test (DBeaver's
# driver) Debian's pgjdbc; a fresh machine (CI) gets them from apt. Skipped when they are
# already there.
system-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null \
			|| ! command -v psql >/dev/null || ! command -v promtool >/dev/null \
			|| ! command -v systemd-analyze >/dev/null || ! command -v kcat >/dev/null \
			|| ! command -v etcd >/dev/null || ! command -v java >/dev/null \
			|| [ ! -e /usr/share/java/postgresql.jar ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver \
			postgresql-client prometheus systemd kcat etcd-server openjdk-17-jdk-headless \
			libpostgresql-jdbc-java >/dev/null; \
	fi

# Two workers, a test file each at a time (its module fixtures' servers stay one): most
# tests wait on server processes, so 2 cores run the suite in about 0.6 of the time.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

pytest: $(STAMP) system-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test: lint typecheck pytest

# Rewrite protocols/rivven/rivven_pb2.py(i) from rivven.proto after editing the schema
# (tests/conformance/test_rivven_vectors.py fails while they disagree).
rivven-proto: $(STAMP)
	$(BIN)/python -m headwater.protocols.rivven.regenerate

# etcd and three nodes on this machine, every listener on a free port, data in
# ./cluster-data; prints each node's ports; Ctrl-C stops them all (docs/cluster.md).
cluster: $(RUN_STAMP) system-deps
	$(BIN)/python -m headwater.cluster.local --dir ./cluster-data

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
