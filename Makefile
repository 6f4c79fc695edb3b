# Set-up and entry points. `make test` and `make demo` create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: test test-fast demo generate-demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[test]' $(TORCH_CPU)
	touch $@

venv: $(VENV)/.installed

# pytest exits 5 when it collected no tests; that must fail, so no special-casing here.
test: $(VENV)/.installed
	$(PY) -m pytest tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest tests -m "not slow"

# GRPO on the committed tiny model (two-digit addition): held-out accuracy before and after,
# runs/demo/summary.json, metrics.jsonl, a reward-curve PNG and an offline wandb run.
demo: $(VENV)/.installed
	$(PY) -m trainers.grpo --config examples/grpo_tiny/grpo.toml

generate-demo: $(VENV)/.installed
	$(PY) examples/offline_generate.py

bench: $(VENV)/.installed
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
