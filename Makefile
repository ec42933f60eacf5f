# kvtier: `make demo` runs a local 12-node cluster end to end; `make test` runs the test suite.
# Both create .venv and install everything on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench lint system-deps clean

# Debian's ISA-L (libisal2) is the fastest erasure-code backend (PERF.md: 12 GB/s at 1 MiB); the pyeclib
# wheel brings its own copy, so this step is an optimisation and never fails the build.
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q 'libisal.so.2' && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian libisal2 (ISA-L)"; \
		(apt-get install -y -qq libisal2 >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libisal2 >/dev/null 2>&1)) || \
		echo "libisal2 unavailable: using the ISA-L bundled with pyeclib"; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: system-deps $(STAMP)
	$(PY) -m pytest -q

demo: system-deps $(STAMP)
	$(PY) -m kvtier.tools.demo

bench: system-deps $(STAMP)
	$(PY) benchmarks/codec_bench.py
	$(PY) benchmarks/store_bench.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
