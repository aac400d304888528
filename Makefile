# Two commands for a newcomer (README): `make demo` runs the main job (the local engine,
# then the plugin inside vLLM), `make test` the tests.
# Both run scripts/setup first, which is a no-op once the venv is up to date.
PY := .venv/bin/python

.PHONY: setup demo kernels test lint bench clean

setup:
	@bash scripts/setup

demo: setup
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
