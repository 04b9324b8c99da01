"""Test ordering for `make test` (`pytest -n 2 --dist loadfile --no-loadscope-reorder`).

`--dist loadfile` keeps each file on one worker, so a module-scoped fixture (a loaded SmolLM2, a live server, its
compiled executables) is built once, not once per worker as `--dist load` does when it splits a file's tests.
Files are then handed out in collection order; putting the heaviest first (longest-processing-time-first) keeps
one of them from starting last and running alone while the other worker idles. The list holds the files that
took over a minute each, heaviest first, measured one file at a time on the 2-core CI-like host (2026-12-02);
every other file keeps its place after them. Order inside a file is never changed (test_server.py's drain test
must stay last).
"""

from __future__ import annotations

HEAVY_FIRST = (  # serial seconds, one file at a time, before this ordering: 330 307 279 275 244 207 133 101 52
    "test_engine.py",
    "test_parallel_pipeline.py",
    "test_parallel_multihost_binaries.py",
    "test_server.py",
    "test_spec_engine.py",
    "test_parallel_engine.py",
    "test_server_clients.py",
    "test_speculative.py",
    "test_parallel_multihost.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order and test order kept
