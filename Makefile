# Two commands for users: `make serve` and `make test`. Everything they need is set up here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpserve-installed
CACHE ?= $(HOME)/.cache/dpserve
PYTEST_ARGS ?=
# Extra `dpserve serve` flags: make serve ARGS="--port 9000 --api-key K"
ARGS ?=

.PHONY: setup serve test test-fast lint cluster-bins s3-bins browser hub-server bench-cfg images clean

setup: $(STAMP)

# Reinstalled when pyproject.toml changes; pip's cache makes a rebuild cheap.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[worker,router,operator,dev]'
	touch $@

serve: $(STAMP)
	$(VENV)/bin/dpserve serve --dp-size 2 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dpserve tests bench
	$(VENV)/bin/ruff format --check dpserve tests bench
	$(VENV)/bin/mypy

# Every tier: unit, gang (multi-process worker gangs), e2e, cluster (a real control
# plane built once from the Kubernetes Go modules into ~/.cache/dpserve/k8s), s3 (an S3
# server built once from its Go module into ~/.cache/dpserve/s3), and browser (Debian's
# chromium, installed once); the hf:// tests' hub server (olah in its own venv and
# Debian's nginx binary under ~/.cache/dpserve/hub, and Debian's git-lfs) is installed once too.
# Two pytest processes side by side, one lane each (tests/lanes.sh).
test: lint cluster-bins s3-bins browser hub-server
	bash tests/lanes.sh $(PY) --durations=15 $(PYTEST_ARGS)

cluster-bins:
	bash tests/cluster/build.sh >/dev/null

s3-bins:
	bash tests/storage/build.sh >/dev/null

browser:
	bash tests/browser/setup.sh

hub-server:
	PYTHON=$(PYTHON) bash tests/hub/setup.sh >/dev/null

# The quick loop while working: skips the gang, e2e, cluster and browser tiers.
test-fast: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist load -m "not gang and not e2e and not cluster and not browser" $(PYTEST_ARGS)

bench-cfg: $(STAMP)
	$(PY) bench/cfg_parallel.py

# The operator, router and worker images, built here with no container registry: a
# local Debian base, the machine's pip config as build secrets (docs/images.md).
images:
	bash images/build.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
