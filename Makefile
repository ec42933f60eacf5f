# kvtier: `make demo` runs a local 12-node cluster end to end; `make test` runs the test suite.
# Both create .venv and install everything on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m kvtier.tools.demo

bench: $(STAMP)
	$(PY) benchmarks/codec_bench.py
	$(PY) benchmarks/store_bench.py
	$(PY) benchmarks/floor_bench.py
	$(PY) benchmarks/gc_bench.py
	$(VENV)/bin/kvbench fetch
	$(VENV)/bin/kvbench stateblock
	$(VENV)/bin/kvbench swapin
	$(VENV)/bin/kvbench ttft

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
