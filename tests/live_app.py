"""Test support: serve an ASGI app of serving/api/app.py on a free loopback port in a thread, until healthy."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from serving.api import app as srv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving_in_thread(asgi, *, health_timeout_s: float = 900, **uvicorn_options):
    """Runs `asgi` under a DrainingServer in a daemon thread; yields (server, thread, url) once /health is 200."""
    port = free_port()
    options = dict(log_level="warning", lifespan="on") | uvicorn_options
    server = srv.DrainingServer(uvicorn.Config(asgi, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + health_timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert thread.is_alive() and time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.3)
    try:
        yield server, thread, url
    finally:
        server.should_exit = True
        thread.join(timeout=120)
