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

.PHONY: help venv check-java jvm demo test bench-ingest horovod clean distclean

help:
	@echo "make demo          set up .venv if needed, then train a small model on the bundled digits data"
	@echo "make test          set up .venv if needed, then run the whole test suite"
	@echo "make venv          create/refresh .venv (pip runs only when $(DEPS) changed)"
	@echo "make check-java    verify Java >= $(MIN_JAVA) (PySpark needs it)"
	@echo "make jvm           compile jvm-bridge/ with javac into $(JAR) (Preflight, BarrierWatch)"
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
	  $(VPY) -c "from sparkdl.jvm import build_jar; print('built', build_jar())"; \
	else echo "$(JAR) is up to date"; fi

demo: venv check-java jvm
	$(SPARK_ENV) $(VENV)/bin/sparkdl demo

# Horovod is built (about 6 minutes cold on 2 cores, seconds from the wheel cache) so that its
# tests run; SPARKDL_REQUIRE_HOROVOD makes them fail rather than skip if it is missing.
test: venv check-java jvm horovod
	$(SPARK_ENV) SPARKDL_REQUIRE_HOROVOD=1 $(VPY) -m pytest tests -q -p no:cacheprovider

bench-ingest: venv check-java
	$(SPARK_ENV) $(VPY) benchmarks/ingest.py

# Horovod 0.28.1 must be compiled from its sdist with C++17 for torch >= 2.1 (DESIGN.md,
# "Things that bite"); the script caches the wheel in SPARKDL_WHEEL_CACHE (~/.cache/sparkdl/wheels).
horovod: venv
	PYTHON=$(VPY) bash scripts/build_horovod.sh

clean:
	rm -rf build dist *.egg-info .pytest_cache spark-warehouse metastore_db derby.log $(JAR)
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
