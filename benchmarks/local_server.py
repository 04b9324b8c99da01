"""Start, probe and stop `python -m serving.server` as a subprocess on a loopback port.

Shared by the tools that drive a real server over HTTP (tools/soak.py, the `serving` mode of benchmarks/bench.py)
and their tests. Only loopback addresses are used: these helpers never bind or reach anything else.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_loopback_url(url: str) -> str:
    """Returns `url` without a trailing slash; raises ValueError unless it is http(s) on a loopback host."""
    parsed = urllib.parse.urlsplit(url)
    host = (parsed.hostname or "").lower()
    if parsed.scheme not in ("http", "https") or not host:
        raise ValueError(f"{url!r} is not an http(s) URL such as http://127.0.0.1:8000")
    loopback = host in LOOPBACK_HOSTS
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host) in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
        except ValueError:
            loopback = False
    if not loopback:
        raise ValueError(
            f"refusing {url!r}: only a server on this machine's loopback interface "
            f"({', '.join(LOOPBACK_HOSTS)}) may be benchmarked, not host {host!r}"
        )
    return url.rstrip("/")


def start_server(port: int, server_args: list[str], log_level: str = "warning", stdout=None) -> subprocess.Popen:
    """Starts the server binary on 127.0.0.1:`port` with extra flags; returns at once (see wait_healthy)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Host and port come last so that they win over anything in server_args: the server stays on loopback.
    cmd = [
        sys.executable,
        "-m",
        "serving.server",
        "--log_level",
        log_level,
        *server_args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    print("server:", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> float:
    """Polls /health until 200; returns the seconds waited. Raises RuntimeError if `proc` dies or time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before becoming healthy")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 120.0) -> int | str:
    """SIGTERM (the server drains in-flight requests), then a kill after `timeout`; returns the exit status."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"killed after {timeout:.0f} s"


def read_metrics(url: str) -> dict[str, float]:
    """The unlabelled series of /metrics (Prometheus text) as {name: value}."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class StreamError(Exception):
    """An SSE stream that answered with an HTTP error or an `error` event."""


async def sse_chunks(response):
    """Parsed `data:` events of an OpenAI-style SSE response, stopping at `[DONE]` (then yields None once).

    Raises StreamError for a non-200 answer or an error event, so callers handle both in one place.
    """
    if response.status_code != 200:
        raise StreamError(f"HTTP {response.status_code}: {(await response.aread())[:300].decode(errors='replace')}")
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            yield None
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise StreamError(f"stream error: {chunk['error']}")
        yield chunk
