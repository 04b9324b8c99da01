"""Start-up and footprint on a CPU host: `make run` and the server, cold (empty compilation cache) and warm.

    python -m benchmarks.cpu_startup                      # all three, a fresh cache directory (cold, then warm)
    python -m benchmarks.cpu_startup --only run --cache_dir ~/.cache/pallas-serve/xla   # the default cache

Measures, each with the host's load average before and after (a shared host slows every figure):
  run     `python -m serving.generate --max_tokens 48` (what `make run` runs): wall time from process start to
          exit, twice over one cache directory (cold: empty; warm: the second run), and the binary's own lines
          (load, warm-up run, timed run).
  server  `python -m serving.server`: seconds from process start until GET /health answers 200, cold and warm.
  rss     the warm server's resident memory (VmRSS, and the peak VmHWM) after --requests chat completions of
          --max_tokens tokens each, sent --concurrency at a time.

Prints one JSON object (and writes it to --out when given). Every server started here is stopped before exit.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ("Write one sentence about the sea.", "Name three colours.", "What is 12 times 7?", "Say hello in French.")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def time_generate(cache_dir: str, max_tokens: int) -> dict:
    """One `python -m serving.generate` run: wall seconds and the phases it prints."""
    cmd = [sys.executable, "-m", "serving.generate", "--max_tokens", str(max_tokens)]
    cmd += ["--compilation_cache_dir", cache_dir]
    before, t0 = load_average(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"serving.generate failed ({proc.returncode}): {proc.stderr[-2000:]}")
    phases = {}
    for key, pattern in (
        ("load_s", r"loaded .* in ([\d.]+)s"),
        ("warmup_run_s", r"warm-up run .*: ([\d.]+)s"),
        ("timed_run_s", r"tokens in ([\d.]+)s"),
    ):
        m = re.search(pattern, proc.stderr + proc.stdout)
        if m:
            phases[key] = float(m.group(1))
    completions = re.findall(r"completion \((\d+) tokens", proc.stdout)
    return dict(wall_s=round(wall, 2), **phases, completion_tokens=[int(n) for n in completions],
                load_avg_before=before, load_avg_after=load_average())  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """`python -m serving.server` on a free port; `ready_s` is the time from start to /health 200."""

    def __init__(self, cache_dir: str, timeout_s: float = 600.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "serving.server", "--port", str(self.port), "--compilation_cache_dir", cache_dir]
        self.log = tempfile.TemporaryFile()
        self.load_avg_before = load_average()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=self.log, stderr=subprocess.STDOUT)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.output()[-2000:]}")
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"/health not 200 after {timeout_s:.0f} s")
                try:
                    if _get(self.url + "/health", timeout=2.0)[0] == 200:
                        break
                except OSError:
                    pass  # not listening yet
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        self.ready_s = round(time.perf_counter() - t0, 2)
        self.load_avg_after = load_average()
        m = re.search(r"engine ready after ([\d.]+) s", self.output())
        self.engine_ready_s = float(m.group(1)) if m else None  # model load + warm-up, on the engine thread

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def memory_kb(self) -> dict:
        with open(f"/proc/{self.proc.pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}

    def chat(self, model: str, i: int, max_tokens: int) -> int:
        body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": PROMPTS[i % 4]}]}
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["usage"]["completion_tokens"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure_rss(server: Server, requests: int, concurrency: int, max_tokens: int) -> dict:
    model = json.loads(_get(server.url + "/v1/models")[1])["data"][0]["id"]
    before = server.memory_kb()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda i: server.chat(model, i, max_tokens), range(requests)))
    after = server.memory_kb()
    return dict(requests=requests, concurrency=concurrency, max_tokens=max_tokens, completion_tokens=tokens,
                seconds=round(time.perf_counter() - t0, 1), rss_mb_ready=round(before["VmRSS"] / 1024),
                rss_mb_after=round(after["VmRSS"] / 1024), peak_rss_mb=round(after["VmHWM"] / 1024),
                load_avg_after=load_average())  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["run", "server", "rss"], action="append", help="parts to measure (default all)")
    p.add_argument("--cache_dir", help="compilation cache directory (default: a fresh one, removed at exit)")
    p.add_argument("--max_tokens", type=int, default=48, help="tokens per `make run` prompt")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--request_tokens", type=int, default=32, help="max_tokens of each server request")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    parts = set(args.only or ["run", "server", "rss"])
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="pallas-serve-xla-")
    result: dict = {"cache_dir": cache_dir if args.cache_dir else "(fresh)", "cpus": os.cpu_count()}
    try:
        if "run" in parts:
            result["run"] = {"cold": time_generate(cache_dir, args.max_tokens)}
            result["run"]["warm"] = time_generate(cache_dir, args.max_tokens)
        if parts & {"server", "rss"}:
            starts = ["cold", "warm"] if "server" in parts else ["warm"]
            for i, label in enumerate(starts):
                server = Server(cache_dir)
                try:
                    result.setdefault("server", {})[label] = dict(
                        ready_s=server.ready_s, engine_ready_s=server.engine_ready_s,
                        load_avg_before=server.load_avg_before, load_avg_after=server.load_avg_after)  # fmt: skip
                    if "rss" in parts and i == len(starts) - 1:
                        result["rss"] = measure_rss(server, args.requests, args.concurrency, args.request_tokens)
                finally:
                    server.stop()
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
