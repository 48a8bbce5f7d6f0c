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
	$(VENV)/bin/specflow run configs/quickstart.yaml

test: setup
	$(VENV)/bin/pytest -n 2 --dist loadgroup -q

test-slow: setup
	$(VENV)/bin/pytest -m slow -q

test-gpu: setup
	$(VENV)/bin/pytest -m gpu -q

bench: setup
	$(VENV)/bin/specflow bench zoo/tiny-code/target --batch-sizes 1 8 --out runs/bench/cpu_decode.json

clean:
	rm -rf $(VENV) .cache runs
