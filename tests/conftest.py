"""Test ordering for `make test` (`pytest -n 2 --dist loadfile --no-loadscope-reorder`).

`--dist loadfile` keeps each file on one worker, so a module-scoped fixture (a loaded SmolLM2, a live server, its
compiled executables) is built once, not once per worker as `--dist load` does when it splits a file's tests.
Files are then handed out in collection order; putting the heaviest first (longest-processing-time-first) keeps
one of them from starting last and running alone while the other worker idles. The list holds the files that
took over a minute each, heaviest first, measured on the shared 2-core host (2026-12-02, --durations); every
other file keeps its place after them. Order inside a file is never changed (test_server.py's drain test
must stay last).
"""

from __future__ import annotations

HEAVY_FIRST = (  # serial seconds per file, one file at a time (before this session's cuts to some of them)
    "test_engine.py",  # 321
    "test_parallel_pipeline.py",  # 304
    "test_parallel_multihost_binaries.py",  # 274
    "test_server.py",  # 266
    "test_spec_engine.py",  # 233
    "test_parallel_engine.py",  # 204
    "test_research.py",  # 167
    "test_parallel_data.py",  # 135
    "test_server_clients.py",  # 125
    "test_parallel_moe_a2a.py",  # 107
    "test_gemma3.py",  # 104
    "test_structured.py",  # 93
    "test_speculative.py",  # 92
    "test_ragged_paged_attention.py",  # 82
    "test_medusa.py",  # 82
    "test_oracle.py",  # 68
    "test_quant_engine.py",  # 67
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order and test order kept
