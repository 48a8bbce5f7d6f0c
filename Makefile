# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the CPU suite).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
EXTRAS ?= dev

.PHONY: setup demo test test-slow test-gpu bench clean

setup: $(VENV)/.installed-$(EXTRAS)

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $@

# the main job: a speculative-decoding experiment against the same-run baseline
demo: setup
	test -f .cache/tiny-random/config.json || $(VENV)/bin/specflow make-model .cache/tiny-random
	$(VENV)/bin/specflow run configs/quickstart.yaml

test: setup
	$(VENV)/bin/pytest -n 2 --dist loadgroup -q

test-slow: setup
	$(VENV)/bin/pytest -m slow -q

test-gpu: setup
	$(VENV)/bin/pytest -m gpu -q

bench: setup
	test -f .cache/tiny-random/config.json || $(VENV)/bin/specflow make-model .cache/tiny-random
	$(VENV)/bin/specflow bench .cache/tiny-random --batch-sizes 1 8

clean:
	rm -rf $(VENV) .cache runs
