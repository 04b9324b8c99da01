"""Test ordering for `make test` (`pytest -n 2 --dist loadfile --no-loadscope-reorder`).

`--dist loadfile` keeps each file on one worker, so a module-scoped fixture (a loaded SmolLM2, a live server, its
compiled executables) is built once, not once per worker as `--dist load` does when it splits a file's tests.
Files are then handed out in collection order; putting the heaviest first (longest-processing-time-first) keeps
one of them from starting last and running alone while the other worker idles. The list holds the files that
took a minute or more, heaviest first, measured on the 2-core host (2026-12-07); every other file keeps its place
after them. Order inside a file is never changed (test_server.py's drain test must stay last).
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

HEAVY_FIRST = (  # seconds per file (setup, calls and teardown; JUnit times of a clean-clone `make test`, 2-core host)
    "test_engine.py",  # 298
    "test_ray_serve.py",  # 294
    "test_spec_engine.py",  # 242
    "test_server.py",  # 215
    "test_spec_device_loop.py",  # 165
    "test_parallel_pipeline.py",  # 144
    "test_research.py",  # 118
    "test_parallel_engine.py",  # 116
    "test_server_clients.py",  # 108
    "test_quant_engine.py",  # 108
    "test_parallel_data.py",  # 90
    "test_gemv.py",  # 89
    "test_parallel_multihost_binaries.py",  # 89
    "test_moe_quant.py",  # 88
    "test_structured.py",  # 79
    "test_medusa.py",  # 78
    "test_stream_matmul_mgpu.py",  # 73
    "test_quant_stream_layout.py",  # 69
    "test_parallel_moe_a2a.py",  # 68
    "test_oracle.py",  # 68
    "test_bench_serving.py",  # 68
    "test_hf_models.py",  # 60
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
