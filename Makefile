# gpushare: the two commands of the README, and what they need.
#
#   make demo   two notebook sessions contend for one GPU on an embedded broker
#               (the real GPU if NVML and CuPy work, the simulated H200 otherwise)
#   make test   the whole test suite (CPU; GPU tests skip cleanly without a GPU)
#
# Each bootstraps what it needs: a virtual environment built with Debian's python3
# (readable by every user, which the multi-user tests need), the package with its
# extras (the JupyterLab extension is built by npm during the install), Chromium for
# the browser tests and configurable-http-proxy for the JupyterHub test.

SHELL := /bin/bash
PYTHON ?= /usr/bin/python3
VENV ?= .venv
EXTRAS ?= notebook,lab,toolchain,hub,distributed,test,bench
# The distributed-training tests train with torch.distributed (gloo) on the CPU; this
# release's CPU build is the one a fresh machine of this kind has on its disk (a plain
# "torch" would fetch a CUDA build of several GB).  An installed torch is kept.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.gpushare-installed
PYTEST_ARGS ?=

.PHONY: demo test venv lint system-deps clean gpu-test

demo: venv
	$(VENV)/bin/gpushare demo

test: venv system-deps
	@mkdir -p test-output
	set -o pipefail; $(VENV)/bin/python -m pytest $(PYTEST_ARGS) 2>&1 | tee test-output/pytest.log; \
	status=$${PIPESTATUS[0]}; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; \
	exit $$status

gpu-test: venv
	$(VENV)/bin/python -m pytest -m gpu $(PYTEST_ARGS)

venv: $(STAMP)

$(STAMP): pyproject.toml
	@if ! $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null; then \
		apt-get update -qq && apt-get install -y -qq python3-venv; fi
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	@$(VENV)/bin/python -c 'import torch' 2>/dev/null || $(VENV)/bin/python -m pip install -q "$(TORCH)"
	@touch $(STAMP)

system-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
		echo "installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi
	@if ! command -v configurable-http-proxy >/dev/null; then \
		echo "installing configurable-http-proxy for the JupyterHub test"; \
		npm install -g --silent configurable-http-proxy@5.3.0; fi

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check gpushare_ext tests benchmarks

clean:
	rm -rf $(VENV) build dist test-output gpushare_ext/labextension labextension/lib labextension/node_modules
