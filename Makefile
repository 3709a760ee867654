# pitstop: two commands do everything on a fresh machine.
#   make demo   set up, then run a local cluster, a live training job and an evacuation
#   make test   set up, then run the whole test suite
#   make check  lint, type check and unit tests only (the edit loop)
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CRIU_STAMP := $(VENV)/.criu
BENCH_STAMP := $(VENV)/.bench
PYTEST_ARGS ?=

.PHONY: all setup criu criu-zdtm native check test test-fast demo bench bench-compare bench-heartbeat bench-projection doctor clean gpu-bundle gpu-check qualify

all: setup

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) (Python >= 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 is the CPU build (pinned in pyproject's test extra)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# CRIU >= 4.2: the host's if good enough, else Debian's in a private prefix (cached in ~/.cache/pitstop);
# then the CRIU pitstop carries, 4.2.1 with criu/patches/ (scripts/build-criu.sh), which runs where it
# builds.  A failed build leaves the stock CRIU in use (`make doctor` says which runs, and its cost).
$(CRIU_STAMP): scripts/provision-criu.sh scripts/build-criu.sh criu/patches/series $(wildcard criu/patches/*.patch) | $(STAMP)
	scripts/provision-criu.sh >/dev/null
	scripts/build-criu.sh >/dev/null || echo "make: the carried CRIU did not build; the stock CRIU runs (see above)" >&2
	touch $@

criu: $(CRIU_STAMP)

# CRIU's own tests (zdtm: copy-on-write, forks, mappings, lazy restore, and the tests the patches
# add; criu/zdtm.list) against the carried build, as root (about a minute).  `make test` runs them
# too (tests/test_criu_carried.py).
criu-zdtm: setup
	scripts/criu-zdtm.sh

native:
	@if [ -f native/Makefile ]; then $(MAKE) -C native; fi
	@if [ -f shim/Makefile ]; then $(MAKE) -C shim; fi

setup: $(STAMP) $(CRIU_STAMP) native

doctor: setup
	$(BIN)/pitstop doctor

# The edit loop: lint, type check and the unit tests (no CRIU, no end-to-end), in about two minutes.
check: $(STAMP) native
	$(BIN)/ruff check service tests bench scripts
	$(BIN)/mypy service/pitstop
	$(BIN)/python -m pytest -q -m "not e2e and not slow" -p no:cacheprovider --durations=5 $(PYTEST_ARGS)

# The suite's modules on two parallel workers (TEST_WORKERS, default 2), each module whole on one
# (most of an end-to-end test's time is waiting on a job, not computing), and the REST APIs'
# fuzzing apart (schemathesis does not parametrize its cases on a worker): about 22-25 minutes on 2
# cores instead of 34-40.  TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup
ifeq ($(TEST_WORKERS),0)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
else
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --ignore=tests/test_api_fuzz.py $(PYTEST_ARGS)
	$(BIN)/python -m pytest tests/test_api_fuzz.py $(PYTEST_ARGS)
endif

demo: setup
	$(BIN)/python scripts/demo.py

$(BENCH_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $@

bench: setup
	$(BIN)/python bench/move_one_rank.py
	$(BIN)/python bench/shim_bench.py
	$(BIN)/python bench/stream_rate.py
	$(BIN)/python bench/delta_cost.py
	$(BIN)/python bench/compress_link.py

# pitstop vs its data floor, checkpoint-restart and naive CRIU, scaling 2/4/8 ranks, each size 3
# times (about 18 min); writes bench/out/compare.json and compare.png.  BENCH_ARGS="--repeats 3"
# for medians of the 4-rank methods too (about 37 min), "--state-mb 2048" for bigger ranks.
# Each finished run is kept in bench/out/compare.partial.json as it ends (removed at the end).
# The at-scale projection from kept measurements (no run needed): its table and its chart.
bench-projection: setup $(BENCH_STAMP)
	$(BIN)/python bench/projection.py --markdown --chart bench/out/projection.png

bench-compare: setup $(BENCH_STAMP)
	$(BIN)/python bench/compare.py $(BENCH_ARGS)

# The fault-injection matrix and the soak (tests/qualify): prints fault x outcome and keeps
# the latest in docs/reliability.md.  Not part of `make test` (about 20 minutes on 2 cores).
qualify: setup
	PITSTOP_QUALIFY_DOC=docs/reliability.md $(BIN)/python -m pytest tests/qualify -p no:cacheprovider $(PYTEST_ARGS)

# GPU validation (tests/gpu): pack CRIU and wheels for a GPU host without registry access,
# then run the one-shot check there (`make gpu-check`, or `bash tests/gpu/run.sh`).
gpu-bundle: setup
	scripts/gpu-bundle.sh

gpu-check:
	bash tests/gpu/run.sh

clean:
	rm -rf $(VENV) build *.egg-info service/*.egg-info
