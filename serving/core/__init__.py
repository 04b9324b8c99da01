"""Host core: requests, sampling parameters, the KV block manager, the radix prefix cache and the scheduler.

Pure Python: nothing under serving/core imports JAX (tests/test_layout.py checks), so the scheduling state is
testable with tiny pools and exact block ids.
"""
