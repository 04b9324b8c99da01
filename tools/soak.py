"""Loopback soak test of the HTTP server: steady request rate for a fixed time, then a leak check.

    python tools/soak.py --duration_s 600 --rate 0.5 --out /tmp/soak.json -- --max_num_seqs 8 --attention_backend xla

Starts `python -m serving.server` on a free loopback port (flags after `--` go to the server), waits for /health,
then sends one request every 1/rate seconds (open loop: arrivals do not wait for completions) for duration_s.
Requests mix completions and chat, streaming and not, greedy and seeded sampling, over prompts that share
prefixes (so the prefix cache is used); a fraction of streaming clients hang up on purpose after the first
chunk (counted as `cancelled`, not `failed`). Afterwards it waits for in-flight requests, reads /metrics, sends
SIGTERM and records the exit status.

With --burst N, N more requests are sent at once after the steady phase (against a server started with
--max_queue N/2 this is 2x the queue limit). A request answered 503 + Retry-After (queue full) is retried after
the advertised delay, up to --max_retries times: pushed back is not lost. `lost` counts requests that never
completed for any other reason (an error status, a broken stream, retries exhausted) and must be 0.

Prints and saves JSON: requests sent / completed / failed / lost / cancelled, 503s retried, latency
percentiles, tokens, and the KV blocks in use at the end, both in total and beyond the prefix cache (the latter
must be 0). Exit status 1 when any request failed, blocks leaked or the server did not exit cleanly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import sys
import time

import httpx
from absl import app, flags

from benchmarks.local_server import (
    StreamError,
    free_port,
    read_metrics,
    sse_chunks,
    start_server,
    stop_server,
    wait_healthy,
)

FLAGS = flags.FLAGS
flags.DEFINE_float("duration_s", 600.0, "how long requests are sent")
flags.DEFINE_float("rate", 0.5, "requests per second")
flags.DEFINE_integer("min_tokens", 8, "smallest max_tokens of a request")
flags.DEFINE_integer("max_tokens", 32, "largest max_tokens of a request")
flags.DEFINE_float("stream_fraction", 0.5, "share of streaming requests")
flags.DEFINE_float("cancel_fraction", 0.05, "share of streaming requests whose client hangs up after one chunk")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_string("url", None, "soak an already running server instead of starting one")
flags.DEFINE_string("model_name", "SmolLM2-135M-Instruct", "`model` field of the requests")
flags.DEFINE_float("startup_timeout_s", 1800.0, "how long the server may take to report healthy")
flags.DEFINE_float("request_timeout_s", 300.0, "client timeout per request")
flags.DEFINE_string("out", None, "write the JSON summary here too")
flags.DEFINE_integer("burst", 0, "requests sent at once after the steady phase (0: none)")
flags.DEFINE_integer("max_retries", 30, "retries of a request answered 503 with Retry-After (queue full)")

_PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely. ",
    "The following is a short story about a lighthouse keeper and the sea. ",
]
_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about rain.",
    "Explain what a hash table is.",
    "Count from one to five.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
]


@dataclasses.dataclass
class Result:
    kind: str
    ok: bool
    cancelled: bool = False
    latency_s: float = 0.0
    ttft_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None
    retries: int = 0


def make_request(rng: random.Random) -> tuple[str, dict, bool, bool]:
    """(path, body, stream, hang_up) of one random request."""
    stream = rng.random() < FLAGS.stream_fraction
    hang_up = stream and rng.random() < FLAGS.cancel_fraction
    prefix, question = rng.choice(_PREFIXES), rng.choice(_QUESTIONS)
    body = {"model": FLAGS.model_name, "max_tokens": rng.randint(FLAGS.min_tokens, FLAGS.max_tokens), "stream": stream}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return (
            "/v1/chat/completions",
            body | {"messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}]},
            stream,
            hang_up,
        )
    return "/v1/completions", body | {"prompt": prefix + question}, stream, hang_up


class _PushedBack(Exception):
    def __init__(self, delay_s: float):
        self.delay_s = delay_s


def _push_back(r: httpx.Response) -> None:
    """Raises _PushedBack for a 503 with Retry-After (the server's queue is full: retry later)."""
    if r.status_code == 503 and "retry-after" in r.headers:
        raise _PushedBack(float(r.headers["retry-after"]))


async def run_one(client: httpx.AsyncClient, path: str, body: dict, stream: bool, hang_up: bool) -> Result:
    """One request, retried after each 503 + Retry-After up to --max_retries times."""
    for attempt in range(FLAGS.max_retries + 1):
        try:
            result = await _attempt(client, path, body, stream, hang_up)
        except _PushedBack as e:
            await asyncio.sleep(min(e.delay_s, 5.0) * random.uniform(0.5, 1.5))
            continue
        result.retries = attempt
        return result
    return Result(path, False, error=f"still 503 after {FLAGS.max_retries} retries", retries=FLAGS.max_retries)


async def _attempt(client: httpx.AsyncClient, path: str, body: dict, stream: bool, hang_up: bool) -> Result:
    kind = ("stream " if stream else "") + path.rsplit("/", 1)[-1]
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await client.post(path, json=body)
            _push_back(r)
            if r.status_code != 200:
                return Result(kind, False, error=f"HTTP {r.status_code}: {r.text[:200]}")
            data = r.json()
            ok = all(c.get("finish_reason") in ("stop", "length") for c in data["choices"])
            return Result(
                kind,
                ok,
                latency_s=time.perf_counter() - t0,
                completion_tokens=data["usage"]["completion_tokens"],
                error=None if ok else f"bad finish: {data['choices']}",
            )
        return await _run_stream(client, kind, path, body, hang_up, t0)
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return Result(kind, False, latency_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")


async def _run_stream(client, kind, path, body, hang_up, t0) -> Result:
    ttft, usage, finished, done = None, None, False, False
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            _push_back(r)
            return Result(kind, False, error=f"HTTP {r.status_code}: {r.text[:200]}")
        try:
            async for chunk in sse_chunks(r):
                if chunk is None:
                    done = True
                    break
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t0
                    if hang_up:
                        return Result(kind, True, cancelled=True, latency_s=ttft, ttft_s=ttft)
                finished |= any(c.get("finish_reason") for c in chunk.get("choices", []))
                usage = chunk.get("usage") or usage
        except StreamError as e:
            return Result(kind, False, error=str(e))
    ok = done and finished and usage is not None
    return Result(
        kind,
        ok,
        latency_s=time.perf_counter() - t0,
        ttft_s=ttft,
        completion_tokens=usage["completion_tokens"] if usage else 0,
        error=None if ok else f"incomplete stream (done={done}, finished={finished})",
    )


async def soak(url: str) -> tuple[list[Result], float]:
    rng = random.Random(FLAGS.seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=FLAGS.request_timeout_s, limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        i = 0
        while (due := t0 + i / FLAGS.rate) < t0 + FLAGS.duration_s:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(run_one(client, *make_request(rng))))
            i += 1
        tasks += [asyncio.create_task(run_one(client, *make_request(rng))) for _ in range(FLAGS.burst)]
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[Result], wall: float, metrics: dict, exit_code, startup_s) -> dict:
    done = [r for r in results if r.ok and not r.cancelled]
    lat = [r.latency_s for r in done]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    failed = [r for r in results if not r.ok]
    used = metrics.get("pallas_serve_kv_blocks_used")
    cached = metrics.get("pallas_serve_kv_blocks_cached")
    return {
        "duration_s": FLAGS.duration_s,
        "rate_per_s": FLAGS.rate,
        "wall_s": round(wall, 1),
        "server_startup_s": startup_s,
        "requests_sent": len(results),
        "completed": len(done),
        "failed": len(failed),
        "lost": len(failed),
        "pushed_back_503_retried": sum(r.retries for r in results),
        "requests_pushed_back": sum(r.retries > 0 for r in results),
        "burst": FLAGS.burst,
        "cancelled_on_purpose": sum(r.cancelled for r in results),
        "failure_samples": [f"{r.kind}: {r.error}" for r in failed[:5]],
        "latency_s": {k: percentile(lat, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
        "stream_ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "completion_tokens": sum(r.completion_tokens for r in done),
        "kv_blocks_used_end": used,
        "kv_blocks_prefix_cache_end": cached,
        "kv_blocks_in_requests_end": metrics.get("pallas_serve_kv_blocks_in_requests"),
        "running_end": metrics.get("pallas_serve_running_sequences"),
        "queue_end": metrics.get("pallas_serve_queue_length"),
        "prefix_cache_hit_rate": metrics.get("pallas_serve_prefix_cache_hit_rate"),
        "preemptions": metrics.get("pallas_serve_preemptions"),
        "server_exit_code": exit_code,
    }


def main(argv) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    server_args = argv[1:]
    proc = None
    url = FLAGS.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(port, server_args)
    exit_code = None
    try:
        startup = round(wait_healthy(url, proc, FLAGS.startup_timeout_s), 1)
        print(f"healthy after {startup} s; soaking {FLAGS.duration_s:.0f} s at {FLAGS.rate}/s", file=sys.stderr)
        results, wall = asyncio.run(soak(url))
        time.sleep(1.0)  # Let the engine thread process the last aborts before reading the gauges.
        metrics = read_metrics(url)
    finally:
        if proc is not None:
            exit_code = stop_server(proc, timeout=120)
    summary = summarize(results, wall, metrics, exit_code, startup)
    text = json.dumps(summary, indent=2)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text + "\n")
    clean = summary["failed"] == 0 and summary["kv_blocks_in_requests_end"] == 0 and exit_code in (0, None)
    return 0 if clean else 1


if __name__ == "__main__":
    app.run(main)
