# The README's two commands are `make run` and `make test`; both set everything up from scratch.
PY := .venv/bin/python
export PYTHONPATH := $(CURDIR)

.PHONY: setup model run lint test test-gpu serve bench build-check clean

setup:
	@bash scripts/setup.sh

model: setup
	@$(PY) -m checkpoints.fetch_default

run: model
	@$(PY) -m serving.generate --max_tokens 48

lint: setup
	@$(PY) -m ruff check .
	@$(PY) -m ruff format --check .

# Whole files per worker (a module's loaded model and compiled steps are built once), heaviest first
# (tests/conftest.py orders them; --no-loadscope-reorder keeps that order instead of sorting by test count).
# A test past 10 minutes has its worker's stacks printed and the worker replaced (thread method: a hang inside
# compiled code ends too); past 80 minutes no new test starts, so a slow host still gets the summary.
test: model lint
	@$(PY) tools/gen_build.py --check
	@$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not gpu" --timeout 600 --timeout-method thread --session-timeout 4800 --durations 25 tests

# On a GPU host: add the CUDA 13 build of jax to the set-up's .venv (once), then run the GPU-marked tests, 8 workers
# sharing the GPU; each JAX process allocates GPU memory as it goes instead of preallocating 75% of it.
test-gpu: model
	@$(PY) -c "import jax_cuda13_plugin" 2>/dev/null || $(PY) -m pip install -q -e '.[cuda13,serve,dev]'
	@XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -n 8 -m gpu --timeout 900 tests

serve: model
	@$(PY) -m serving.server

bench: model
	@$(PY) -m benchmarks.bench

build-check: setup
	@$(PY) tools/gen_build.py --check

clean:
	rm -rf .venv .pytest_cache
