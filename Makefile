# Two entry points, both of which set up everything they need on a fresh machine:
#   make serve   the gateway with an embedded SGLang CPU worker on the bundled model
#   make test    the test suite (real SGLang CPU workers, real openai client)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SGLANG_VERSION := 0.5.23
INSTALLED := $(VENV)/.installed

.PHONY: serve test install bench clean

$(INSTALLED): pyproject.toml requirements/sglang-cpu.txt
	@echo "[setup] creating $(VENV) and installing SGLang $(SGLANG_VERSION) (CPU) and the project; a few minutes on first run"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# SGLang's wheel declares CUDA-only packages: install its CPU-usable requirements and the project first, then
	# SGLang alone without its declared ones (in this order pip has no unmet declaration to report).
	$(BIN)/pip install --quiet -r requirements/sglang-cpu.txt -e '.[engine,clip,test]'
	$(BIN)/pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	@touch $@

install: $(INSTALLED)

serve: $(INSTALLED)
	$(BIN)/revisit serve $(ARGS)

test: $(INSTALLED)
	$(BIN)/ruff check gateway engine_ext store dashboards plan settings launcher bundled offline soak tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest $(ARGS)

bench: $(INSTALLED)
	$(BIN)/python bench/gateway_overhead.py $(ARGS)

clean:
	rm -rf $(VENV)
