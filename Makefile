# The README's two commands are `make run` and `make test`; both set everything up from scratch.
PY := .venv/bin/python
export PYTHONPATH := $(CURDIR)

.PHONY: setup model run test test-fast serve bench build-check clean

setup:
	@bash scripts/setup.sh

model: setup
	@$(PY) -m checkpoints.fetch_default

run: model
	@$(PY) -m serving.generate --max_tokens 48

test: model
	@$(PY) tools/gen_build.py --check
	@$(PY) -m pytest -q -m "not gpu" --timeout 900 tests

serve: model
	@$(PY) -m serving.server

bench: model
	@$(PY) -m benchmarks.bench

build-check: setup
	@$(PY) tools/gen_build.py --check

clean:
	rm -rf .venv .pytest_cache
