# Every target creates .venv when it is missing (python3 -m venv) and installs the pinned
# versions from constraints.txt, so `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
# The suite starts many interpreters (test processes, Ray workers, CLI children): each reads the compiled modules
# and pytest's rewritten tests from __pycache__ instead of compiling them again, where the environment sets
# PYTHONDONTWRITEBYTECODE=1 (as these machines do: 10 s of CPU per test process to collect, 0.4 s per import).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: venv demo test check bench lint docs durations clean chromium slurm

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[all,test]'
	$(MAKE) --no-print-directory chromium slurm
	touch $(STAMP)

# Debian's Chromium for the viewer's browser tests (tests/view/test_view.py drives it with Playwright), where missing;
# skipped quietly without root or apt-get (the tests then skip, saying why).
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
		>/dev/null; } || true; }

# Debian's Slurm and munge for the Slurm array test (tests/driver/test_launchers.py runs its own slurmctld and slurmd
# on 127.0.0.1), where missing; skipped quietly without root or apt-get (that test then skips, saying why).
slurm:
	@command -v slurmctld >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge \
		>/dev/null; } || true; }

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/extractor demo

# Test files run in TEST_WORKERS processes (pytest-xdist), each file whole in one of them (its module fixtures
# built once); most slow tests wait on subprocesses, clusters and servers, so three overlap well on 2 cores
# (measured in fresh clones on one machine: 9:37 with two, 8:22 with three; the tests wait on events, not a pace).
TEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Everything (what CI and the README run); the 15 slowest tests are printed so the cost stays visible.
test: $(STAMP)
	$(PYTEST) --durations=15

# tests/file_seconds.json from a whole run (the order conftest.py hands files to the test processes in)
durations: $(STAMP)
	$(PYTEST) --durations=0 | tee .durations.log
	$(PY) tests/file_seconds.py .durations.log

# The fast tier for the edit-test loop: unit and in-process tests, no clusters, servers or CLI subprocesses.
check: $(STAMP)
	$(PYTEST) -m "not slow" --durations=10

bench: $(STAMP)
	$(PY) bench/bench.py $(BENCH_ARGS)

# The docs site from docs/ into site/ (strict: a warning, a broken link or a missing page fails it).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check extractor tests bench jobs examples
	$(VENV)/bin/mypy
	$(PY) tests/complexity.py

clean:
	rm -rf demo .bench .pytest_cache .ruff_cache .mypy_cache
