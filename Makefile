# Two commands for a newcomer (README): `make demo` runs the main job, `make test` the tests.
# Both run scripts/setup first, which is a no-op once the venv is up to date.
PY := .venv/bin/python

.PHONY: setup demo kernels test lint bench clean

setup:
	@bash scripts/setup

demo: setup
	$(PY) -m bench.e2e

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
