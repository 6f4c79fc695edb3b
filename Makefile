# Set-up and entry points. `make test` and `make demo` create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: test test-fast demo demo-lora demo-agent generate-demo bench clean vllm033 clean-vllm033

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[test]' $(TORCH_CPU)
	touch $@

venv: $(VENV)/.installed

# The compat tier's vLLM 0.33 (tests/compat/README.md): the wheel's Python files unpacked into
# build/vllm033/site (its compiled parts left out) and the pure-Python packages those modules
# import, installed without dependencies into build/vllm033/deps. Only tests/compat puts either on
# sys.path. The wheel is fetched by pip with its pinned sha256; an existing download is reused.
VLLM033 := build/vllm033
VLLM033_REQ := tests/compat/vllm033-wheel.txt
VLLM033_DEPS := tests/compat/vllm033-deps.txt

$(VLLM033)/.built: $(VENV)/.installed $(VLLM033_REQ) $(VLLM033_DEPS) tests/compat/build_vllm033.py
	rm -f $@
	$(PY) -m pip download -q --no-deps --only-binary=:all: --require-hashes -r $(VLLM033_REQ) -d $(VLLM033)/wheel
	$(PY) tests/compat/build_vllm033.py $(VLLM033)/wheel/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl $(VLLM033)/site
	rm -rf $(VLLM033)/deps
	$(PY) -m pip install -q --no-deps --target $(VLLM033)/deps -r $(VLLM033_DEPS)
	touch $@

vllm033: $(VLLM033)/.built

clean-vllm033:
	rm -rf $(VLLM033)

# pytest exits 5 when it collected no tests; that must fail, so no special-casing here.
# ROLLOUT_REQUIRE_COMPAT=1: the compat tier was built, so a skip there fails the run (tests/conftest.py).
# Two pytest-xdist workers: run one by one, the tests keep about one core busy (single-threaded
# start-ups, waits on processes and peers), so two share the machine's two cores. A test file stays
# on one worker (its module-scoped servers start once) and the files that use Ray run one at a time
# (the xdist groups of tests/conftest.py). --durations: the slowest tests in every log, to keep CI under 25 minutes.
PYTEST_XDIST := -n 2 --dist loadgroup --durations=30
test: $(VENV)/.installed $(VLLM033)/.built
	ROLLOUT_REQUIRE_COMPAT=1 $(PY) -m pytest tests $(PYTEST_XDIST)

test-fast: $(VENV)/.installed $(VLLM033)/.built
	$(PY) -m pytest tests -m "not slow"

# GRPO on the committed tiny model (two-digit addition): held-out accuracy before and after,
# runs/demo/summary.json, metrics.jsonl, a reward-curve PNG and an offline wandb run.
demo: $(VENV)/.installed
	$(PY) -m trainers.grpo --config examples/grpo_tiny/grpo.toml

# The same GRPO run training a LoRA adapter on the frozen base (only the adapter syncs); runs/demo-lora/.
demo-lora: $(VENV)/.installed
	$(PY) -m trainers.grpo --config examples/grpo_tiny/grpo_lora.toml

# Agentic GRPO: multi-turn sessions with a calculator tool (3-digit x 2-digit products), rewards on the
# final answer, trained on the model's tokens only; runs/demo-agent/ as `make demo` writes runs/demo/.
demo-agent: $(VENV)/.installed
	$(PY) -m trainers.grpo --config examples/agentic_calc/grpo.toml

generate-demo: $(VENV)/.installed
	$(PY) examples/offline_generate.py

bench: $(VENV)/.installed
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
