"""Runs a test's Python script in a fresh process at the repository root.

A test needs its own process where JAX must start differently from the worker's (forced CPU devices for the
sharding tests: XLA_FLAGS is read once, when JAX starts) or where the worker's state would skew what it measures
(a heap holed by earlier tests). The script ends by printing `ok`, or `ok` and a JSON value on the same line;
`run_script` returns that value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(
    script: str, *args: str, devices: int | None = None, timeout: float = 600, env: dict[str, str] | None = None
):
    """Runs `python -c script *args`, with `devices` forced CPU devices when given and `env` added to this
    process's environment; fails the test (with the tails of its output) unless it exits 0 with a last line `ok`
    or `ok <json>`. Returns the JSON value (None after a bare `ok`)."""
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    if devices:
        full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    assert proc.returncode == 0 and last.split(" ", 1)[0] == "ok", proc.stdout[-3000:] + proc.stderr[-5000:]
    payload = last[2:].strip()
    return json.loads(payload) if payload else None
