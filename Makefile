# kvtier: `make demo` runs a local 12-node cluster end to end; `make test` runs the test suite.
# Both create .venv and install what they need on a fresh machine (the demo: its `demo` extra; the tests: their tools too).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ENGINES := $(VENV)/.engines-installed
VLLM := $(VENV)/.vllm-installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: test test-vllm demo bench lint clean system-tools

$(STAMP): pyproject.toml $(wildcard csrc/*.c kernels/*.c)  # the C extensions are built by the install
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# the multi-host tests run etcd members and hosts as network namespaces (iproute2, nftables); installed when
# missing and apt-get is there (CI runs as root on Debian), quietly; already present: nothing is run
SYSTEM_TOOLS := etcd:etcd-server nft:nftables ip:iproute2 tc:iproute2

system-tools:
	@missing="$$(for t in $(SYSTEM_TOOLS); do command -v $${t%%:*} >/dev/null || echo $${t#*:}; done | sort -u)"; \
	if [ -n "$$missing" ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing $$missing"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; }; \
	fi

# the engines the adapters plug into (tests/test_adapter_*.py), CPU-only: see requirements-engines.txt
$(ENGINES): $(STAMP) requirements-engines.txt requirements-adapters.txt
	$(PY) -m pip install -q --no-deps -r requirements-engines.txt
	$(PY) -m pip install -q -r requirements-adapters.txt
	touch $(ENGINES)

# two workers (pytest-xdist), each test file a unit of work so that its module's clusters start once; the files in
# tests/conftest.py's HEAVY are one unit, run one after another on one worker, never beside each other
test: $(STAMP) $(ENGINES) system-tools
	$(PY) -m pytest -q -n 2 --durations=25

# vLLM's tier through vLLM 0.33.0 itself (its 336 MB wheel is left out of `make test`, which then skips those tests):
# vllm with --no-deps on the CPU and what its offloading code imports (requirements-vllm.txt)
$(VLLM): $(STAMP) requirements-vllm.txt
	$(PY) -m pip install -q --no-deps -r requirements-vllm.txt
	touch $(VLLM)

test-vllm: $(VLLM)
	$(PY) -m pytest -q tests/test_adapter_vllm.py

# the demo needs kvtier and its `demo` extra (the engine, the server, the openai client), not the test tools
$(DEMO_STAMP): pyproject.toml $(wildcard csrc/*.c kernels/*.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[demo]'
	touch $(DEMO_STAMP)

DEMO_ARGS ?=
demo: $(DEMO_STAMP)
	$(PY) -m kvtier.tools.demo $(DEMO_ARGS)

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
