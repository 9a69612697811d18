# The two commands of the README: `make demo` and `make test`. Each sets up .venv by itself.
# Re-running is cheap: pip only runs when setup.cfg, requirements-dev.txt or pyproject.toml
# changed since the last install (their hash is recorded in $(STAMP)).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.sparkdl-install-hash
DEPS   := setup.cfg requirements-dev.txt pyproject.toml
MIN_JAVA := 17
JAR    := sparkdl/jars/sparkdl-bridge.jar

# Executors must run the same Python as the driver (DESIGN.md, "Things that bite").
SPARK_ENV := PYSPARK_PYTHON=$(abspath $(VPY)) PYSPARK_DRIVER_PYTHON=$(abspath $(VPY))

.PHONY: help venv check-java jvm demo test test-quick bench bench-venv bench-ingest horovod clean distclean

BENCH_VENV := .venv-bench
BENCH_PY   := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.sparkdl-install-hash
BENCH_DEPS := setup.cfg requirements-bench.txt pyproject.toml
BENCH_ARGS ?=
PETASTORM_VENV := .venv-petastorm
PETASTORM_STAMP := $(PETASTORM_VENV)/.sparkdl-install-hash

help:
	@echo "make demo          set up .venv if needed, then train a small model on the bundled digits data"
	@echo "make test          set up .venv if needed, then run the whole test suite (prints its wall time)"
	@echo "make test-quick    unit tests + Spark smoke tests: no multi-host bed, no Horovod build (< 8 min)"
	@echo "make venv          create/refresh .venv (pip runs only when $(DEPS) changed)"
	@echo "make check-java    verify Java >= $(MIN_JAVA) (PySpark needs it)"
	@echo "make jvm           compile jvm-bridge/ with javac into $(JAR) (Preflight, BarrierWatch)"
	@echo "make bench         set up .venv-bench (sparkdl + peers: TorchDistributor, torchrun, Horovod, Petastorm)"
	@echo "                   and run benchmarks/peers.py (JSON, docs/img/peers.png, table in docs/benchmarks.md);"
	@echo "                   BENCH_ARGS='--repeats 5' passes options"
	@echo "make bench-ingest  run benchmarks/ingest.py (prints JSON)"
	@echo "make horovod       build horovod 0.28.1 against the venv's torch (5-15 min cold, seconds once cached) and install it"
	@echo "make clean         remove build outputs and caches; make distclean also removes .venv"

venv:
	@if [ ! -x "$(VPY)" ] || ! "$(VPY)" -c "" 2>/dev/null; then \
	  if ! command -v "$(PYTHON)" >/dev/null 2>&1; then \
	    echo "error: '$(PYTHON)' not found; install Python >= 3.10 or run make PYTHON=/path/to/python3.X" >&2; exit 1; \
	  fi; \
	  if ! "$(PYTHON)" -c "import sys; sys.exit(sys.version_info < (3, 10))"; then \
	    echo "error: sparkdl needs Python >= 3.10, '$(PYTHON)' is $$("$(PYTHON)" -V 2>&1)" >&2; \
	    echo "HINT: run make PYTHON=python3.11 (or another interpreter >= 3.10)" >&2; exit 1; \
	  fi; \
	  echo "creating $(VENV) with $$("$(PYTHON)" -V 2>&1)"; \
	  rm -rf "$(VENV)"; \
	  "$(PYTHON)" -m venv "$(VENV)" || { \
	    echo "error: '$(PYTHON) -m venv' failed" >&2; \
	    echo "HINT: on Debian/Ubuntu: apt-get install -y python3-venv" >&2; exit 1; }; \
	fi
	@want=$$("$(VPY)" -c "import hashlib, sys; h = hashlib.sha256(); [h.update(open(p, 'rb').read()) for p in sys.argv[1:]]; print(h.hexdigest())" $(DEPS)); \
	if [ -f "$(STAMP)" ] && [ "$$(cat "$(STAMP)")" = "$$want" ]; then \
	  echo "$(VENV) is up to date"; \
	else \
	  echo "installing requirements-dev.txt into $(VENV)"; \
	  "$(VPY)" -m pip install --quiet --upgrade pip || echo "warning: could not upgrade pip; continuing with $$("$(VPY)" -m pip --version)"; \
	  "$(VPY)" -m pip install --quiet -r requirements-dev.txt; \
	  echo "$$want" > "$(STAMP)"; \
	fi

check-java:
	@java="java"; if [ -n "$${JAVA_HOME:-}" ]; then java="$$JAVA_HOME/bin/java"; fi; \
	hint() { \
	  echo "HINT: PySpark needs Java $(MIN_JAVA) or newer. Install it, e.g." >&2; \
	  echo "  Debian/Ubuntu:  apt-get install -y openjdk-17-jre-headless   (sudo if not root; apt-get update first on a fresh image)" >&2; \
	  echo "  macOS:          brew install openjdk@17" >&2; \
	  echo "then put it on PATH or set JAVA_HOME to its home directory." >&2; \
	}; \
	if ! command -v "$$java" >/dev/null 2>&1; then \
	  echo "error: Java not found ($$java)" >&2; hint; exit 1; \
	fi; \
	ver=$$("$$java" -version 2>&1 | sed -n 's/.*version "\([^"]*\)".*/\1/p' | head -n 1); \
	major=$${ver%%.*}; \
	if [ "$$major" = "1" ]; then major=$$(echo "$$ver" | cut -d. -f2); fi; \
	major=$${major%%[!0-9]*}; \
	if [ -z "$$major" ] || [ "$$major" -lt $(MIN_JAVA) ]; then \
	  echo "error: Java $(MIN_JAVA)+ required, found '$${ver:-unknown}' ($$java)" >&2; hint; exit 1; \
	fi; \
	echo "java $$ver ok"

# The JVM bridge: javac against the jars inside the pyspark wheel (no Maven); rebuilt when a source changed.
jvm: venv check-java
	@if [ ! -f "$(JAR)" ] || [ -n "$$(find jvm-bridge/src -name '*.java' -newer "$(JAR)")" ]; then \
	  $(VPY) -c "from sparkdl.spark.jvm import build_jar; print('built', build_jar())"; \
	else echo "$(JAR) is up to date"; fi

demo: venv check-java jvm
	$(SPARK_ENV) $(VENV)/bin/sparkdl demo

# Two lanes at once from the first second, and Horovod's build beside them:
# - the bed lane: the multi-host bed's modules (one bed, mostly waiting on shaped links, cut hosts and
#   timeouts) and the modules marked bed_lane (standalone clusters and other mostly waiting ones);
# - the main lane: everything else;
# - Horovod (about 11 minutes cold on 2 cores, seconds from the wheel cache) builds in the background
#   at a lower priority (HOROVOD_NICE, 5: not so low that it starves; it needs ~20 CPU-minutes cold),
#   its output in $(HOROVOD_LOG). Modules holding a `horovod` test run last in their lane and wait for
#   the build's exit status in $(HOROVOD_STATUS) (tests/conftest.py, which prints how long a lane
#   waited); SPARKDL_REQUIRE_HOROVOD makes those tests fail rather than skip if Horovod does not import.
# The bed lane's output follows the main lane's. `make test` prints its wall time, the build's and
# each lane's exit (the suite's budget: under 30 minutes from a clean clone on a 2-core machine).
BED_LOG := .bed-lane.log
HOROVOD_LOG := .horovod-build.log
HOROVOD_STATUS := .horovod-build.status
HOROVOD_NICE ?= 5
HOROVOD_BUILD ?= bash scripts/build_horovod.sh
BED_LANE := bed or bed_lane
PYTEST_ARGS ?=
LANE_ENV = $(SPARK_ENV) SPARKDL_REQUIRE_HOROVOD=1 SPARKDL_HOROVOD_BUILD_STATUS=$(abspath $(HOROVOD_STATUS))
test: venv check-java jvm
	@start=$$(date +%s); status=0; bed_status=0; rm -f $(HOROVOD_STATUS) $(HOROVOD_STATUS).part; \
	( rc=0; nice -n $(HOROVOD_NICE) env PYTHON=$(VPY) $(HOROVOD_BUILD) > $(HOROVOD_LOG) 2>&1 || rc=$$?; \
	  echo "$$rc" > $(HOROVOD_STATUS).part; mv $(HOROVOD_STATUS).part $(HOROVOD_STATUS) ) & build=$$!; \
	$(LANE_ENV) $(VPY) -m pytest tests/spark -m "$(BED_LANE)" -q -p no:cacheprovider --durations=20 $(PYTEST_ARGS) \
	  > $(BED_LOG) 2>&1 & bed=$$!; \
	trap 'kill $$bed $$build 2>/dev/null || true' INT TERM; \
	$(LANE_ENV) $(VPY) -m pytest tests -m "not ($(BED_LANE))" -q -p no:cacheprovider --durations=60 $(PYTEST_ARGS) \
	  || status=$$?; \
	main_s=$$(( $$(date +%s) - start )); \
	wait $$build || true; build_status=$$(cat $(HOROVOD_STATUS) 2>/dev/null || echo "none"); \
	wait $$bed || bed_status=$$?; \
	echo "---- the multi-host bed lane (tests/spark -m \"$(BED_LANE)\") ----"; cat $(BED_LOG); \
	echo "---- the Horovod build beside the lanes ($(HOROVOD_LOG)) ----"; \
	if [ "$$build_status" = 0 ]; then grep '^\[build_horovod\]' $(HOROVOD_LOG) || true; else tail -n 80 $(HOROVOD_LOG); fi; \
	if [ $$bed_status -eq 5 ]; then bed_status=0; fi; \
	echo "make test: pytest wall time $$(( $$(date +%s) - start )) s (main lane $$main_s s, exit $$status;" \
	  "bed lane exit $$bed_status; Horovod build exit $$build_status)"; \
	[ $$status -eq 0 ] && [ $$bed_status -eq 0 ] && [ "$$build_status" = 0 ]

# Daily work: the unit tests and, beside them, the Spark smoke modules on one local-cluster session;
# no multi-host bed, no Horovod build (Horovod's tests skip). Under 8 minutes on 2 cores.
QUICK_SPARK := tests/spark/test_fit.py tests/spark/test_errors.py tests/spark/test_run.py
QUICK_LOG := .quick-spark-lane.log
test-quick: venv check-java jvm
	@start=$$(date +%s); status=0; spark_status=0; \
	$(SPARK_ENV) $(VPY) -m pytest $(QUICK_SPARK) -q -p no:cacheprovider -m "not bed and not horovod" --durations=5 \
	  > $(QUICK_LOG) 2>&1 & lane=$$!; \
	trap 'kill $$lane 2>/dev/null || true' INT TERM; \
	$(SPARK_ENV) $(VPY) -m pytest tests/unit -q -p no:cacheprovider --durations=10 || status=$$?; \
	wait $$lane || spark_status=$$?; \
	echo "---- the Spark smoke lane ($(QUICK_SPARK)) ----"; cat $(QUICK_LOG); \
	echo "make test-quick: pytest wall time $$(( $$(date +%s) - start )) s (unit exit $$status, Spark exit $$spark_status)"; \
	[ $$status -eq 0 ] && [ $$spark_status -eq 0 ]

bench-ingest: venv check-java
	$(SPARK_ENV) $(VPY) benchmarks/ingest.py

# The peers live in their own venv so that .venv keeps sparkdl's own dependencies only. Petastorm may
# not install or import beside current pyarrow: its pip output is kept and peers.py records the error.
bench-venv: check-java
	@if [ ! -x "$(BENCH_PY)" ] || ! "$(BENCH_PY)" -c "" 2>/dev/null; then \
	  echo "creating $(BENCH_VENV)"; rm -rf "$(BENCH_VENV)"; "$(PYTHON)" -m venv "$(BENCH_VENV)"; fi
	@want=$$("$(BENCH_PY)" -c "import hashlib, sys; h = hashlib.sha256(); [h.update(open(p, 'rb').read()) for p in sys.argv[1:]]; print(h.hexdigest())" $(BENCH_DEPS)); \
	if [ -f "$(BENCH_STAMP)" ] && [ "$$(cat "$(BENCH_STAMP)")" = "$$want" ]; then echo "$(BENCH_VENV) is up to date"; else \
	  "$(BENCH_PY)" -m pip install --quiet --upgrade pip || true; \
	  "$(BENCH_PY)" -m pip install --quiet -r requirements-bench.txt; \
	  if "$(BENCH_PY)" -m pip install petastorm > "$(BENCH_VENV)/petastorm-install.log" 2>&1; then echo "petastorm installed"; \
	  else echo "warning: petastorm did not install (see $(BENCH_VENV)/petastorm-install.log); peers.py records why"; fi; \
	  echo "$$want" > "$(BENCH_STAMP)"; fi
	@want=$$(sha256sum requirements-petastorm.txt | cut -d' ' -f1); \
	if [ -f "$(PETASTORM_STAMP)" ] && [ "$$(cat "$(PETASTORM_STAMP)")" = "$$want" ]; then echo "$(PETASTORM_VENV) is up to date"; else \
	  echo "creating $(PETASTORM_VENV) (Petastorm with PySpark 3.5 and pyarrow 14; see requirements-petastorm.txt)"; \
	  rm -rf "$(PETASTORM_VENV)"; "$(PYTHON)" -m venv "$(PETASTORM_VENV)"; \
	  if "$(PETASTORM_VENV)/bin/python" -m pip install --quiet -r requirements-petastorm.txt; then echo "$$want" > "$(PETASTORM_STAMP)"; \
	  else echo "warning: $(PETASTORM_VENV) did not install; peers.py then records Petastorm's error only"; rm -rf "$(PETASTORM_VENV)"; fi; fi
	PYTHON=$(BENCH_PY) bash scripts/build_horovod.sh
	@if [ ! -f "$(JAR)" ] || [ -n "$$(find jvm-bridge/src -name '*.java' -newer "$(JAR)")" ]; then \
	  $(BENCH_PY) -c "from sparkdl.spark.jvm import build_jar; print('built', build_jar())"; fi

bench: bench-venv
	PYSPARK_PYTHON=$(abspath $(BENCH_PY)) PYSPARK_DRIVER_PYTHON=$(abspath $(BENCH_PY)) SPARKDL_BENCH_VIA_MAKE=1 \
	  $(BENCH_PY) benchmarks/peers.py $(BENCH_ARGS)

# Horovod 0.28.1 must be compiled from its sdist with C++17 for torch >= 2.1 (DESIGN.md,
# "Things that bite"); the script caches the wheel in SPARKDL_WHEEL_CACHE (~/.cache/sparkdl/wheels).
horovod: venv
	PYTHON=$(VPY) bash scripts/build_horovod.sh

clean:
	rm -rf build dist *.egg-info .pytest_cache spark-warehouse metastore_db derby.log $(JAR)
	find . \( -path ./$(VENV) -o -path ./$(BENCH_VENV) -o -path ./$(PETASTORM_VENV) \) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(BENCH_VENV) $(PETASTORM_VENV)
