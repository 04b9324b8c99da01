"""Test ordering for `make test` (`pytest -n 2 --dist loadfile --no-loadscope-reorder`).

`--dist loadfile` keeps each file on one worker, so a module-scoped fixture (a loaded SmolLM2, a live server, its
compiled executables) is built once, not once per worker as `--dist load` does when it splits a file's tests.
Files are then handed out in collection order; putting the heaviest first (longest-processing-time-first) keeps
one of them from starting last and running alone while the other worker idles. The list holds the files that
took over a minute each, heaviest first, measured on the shared 2-core host (2026-12-02, --durations; the files
whose tests were cut re-measured later that day on a quieter host, the others keep their first figure); every
other file keeps its place after them. Order inside a file is never changed (test_server.py's drain test
must stay last).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys

import pytest

# The suite's processes (workers and the servers they start) share no persistent compilation cache: an XLA:CPU
# executable loaded from a cache another process wrote has crashed a worker (a segfault, or "Function ... not
# found"). tests/test_compile_cache.py turns the cache on for the processes it starts.
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

HEAVY_FIRST = (  # serial seconds per file, one at a time (pytest --durations)
    "test_spec_engine.py",  # 233 (2026-12-02 figure, not re-measured)
    "test_engine.py",  # 227
    "test_parallel_engine.py",  # 204 (2026-12-02 figure, not re-measured)
    "test_server.py",  # 142
    "test_moe_quant.py",  # ~150 (2026-12-06, a loaded host; its expert-parallel case runs a fresh process)
    "test_ray_serve.py",  # ~120 (2026-12-06, estimated from a run on a loaded host)
    "test_hf_models.py",  # ~150 (same)
    "test_deepseek_engine.py",  # ~75 of CPU in 4.5 min on a loaded host (same)
    "test_parallel_pipeline.py",  # 128
    "test_parallel_multihost_binaries.py",  # 106
    "test_gemma3.py",  # 100
    "test_structured.py",  # 92 (2026-12-02 figure, not re-measured)
    "test_speculative.py",  # 92 (2026-12-02 figure, not re-measured)
    "test_ragged_paged_attention.py",  # 82 (2026-12-02 figure, not re-measured)
    "test_research.py",  # 77
    "test_server_clients.py",  # 69
    "test_oracle.py",  # 68 (2026-12-02 figure, not re-measured)
    "test_gguf_moe_mla.py",  # ~60 (2026-12-06, a loaded host: two LLM greedy runs of ~25 s)
    "test_quant_engine.py",  # 67 (2026-12-02 figure, not re-measured)
    "test_parallel_data.py",  # 60
    "test_ray_multihost.py",  # ~65 of CPU, 116 s on a loaded host (2026-12-06)
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order and test order kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a file's last test (its module fixtures torn down), drops JAX's compiled executables. A worker runs
    dozens of files; each XLA:CPU executable holds about six memory mappings, and a worker that kept every one it
    compiled passed the kernel's 65,530 (vm.max_map_count) and crashed inside the compiler."""
    yield
    if (nextitem is None or nextitem.path != item.path) and "jax" in sys.modules:
        gc.collect()
        sys.modules["jax"].clear_caches()


# After a worker's last result has gone out, nothing it does should take long; one that hangs there (an exit handler
# waiting on a child process that died, a library thread that never ends) would keep `pytest -n` waiting for it for
# ever. It prints every thread's stack and exits after this many seconds instead.
WORKER_EXIT_GRACE_S = 120


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        faulthandler.dump_traceback_later(WORKER_EXIT_GRACE_S, exit=True)
