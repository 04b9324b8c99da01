"""Hostile audit of the HTTP server on loopback: what a careless or malicious client can do to it, as totals.

    python tools/hostile_audit.py --out /tmp/audit.json -- --max_num_seqs 8 --attention_backend xla
    python tools/hostile_audit.py --categories heavy --num_tools 0 -- --max_model_len 8192   # the long requests

Starts `python -m serving.server --api_key <random> --max_queue Q` on a free loopback port (flags after `--`
go to the server) and runs, in order:

  malformed   bodies that must get a 4xx: bad JSON, bad UTF-8, deep nesting, over-long integers, NaN, wrong
              types, unicode-digit logit_bias keys, unknown fields, over-long prompts, both Content-Length and
              Transfer-Encoding, a non-JSON Content-Type, an empty body, a body over the size cap
  heavy       valid but expensive requests, each beside short requests sent one after another while it runs
              (their count, median and worst latency against the idle latency; the server's RSS growth): a
              prompt near max_model_len, an echo + logprobs over a long prompt (max_tokens 0), a chat with 128
              tools and tool_choice "required"
  auth        missing, malformed and wrong API keys on every /v1 route (401), and the right one (2xx)
  slowloris   sockets that trickle a request head or a body one byte at a time: each must be closed by the
              server (header timeout, body deadline) within its bound
  burst       4 x max_queue short requests at once: each gets a 2xx or a 503 with Retry-After (queue full)
  disconnect  streams dropped after their first chunk and requests whose client times out: afterwards no
              sequence runs and no KV block is held beyond the prefix cache
  sigterm     SIGTERM with streams in flight: the streams end (completed, or an error event and [DONE]) and the
              process exits 0 within --drain_timeout_s + a few seconds

Prints and saves JSON: per category and in total, requests tried, 2xx / 4xx / 5xx (503s, deliberate
back-pressure, counted apart from the other 5xx), hangs (no answer within the client timeout), lost (an
answer that never came for any other reason: a reset, a broken stream, a leaked sequence or KV block), and the
server's RSS before and after. Exit status 1 when any 5xx other than 503, hang or loss was seen.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import random
import secrets
import socket
import statistics
import sys
import time

import httpx
import psutil
from absl import app, flags

from benchmarks.local_server import free_port, read_metrics, sse_chunks, start_server, stop_server, wait_healthy

FLAGS = flags.FLAGS
flags.DEFINE_string("model_name", "SmolLM2-135M-Instruct", "`model` field of the requests")
flags.DEFINE_integer("max_queue", 64, "the server's --max_queue (the burst sends 4x this)")
flags.DEFINE_float("drain_timeout_s", 5.0, "the server's --drain_timeout_s")
flags.DEFINE_float("body_timeout_s", 5.0, "the server's --body_timeout_s (its body deadline is 4x this)")
flags.DEFINE_float("header_timeout_s", 5.0, "the server's --header_timeout_s")
flags.DEFINE_integer("long_prompt_tokens", 8000, "heavy: prompt tokens of the long completion (0: skip)")
flags.DEFINE_integer("echo_tokens", 5000, "heavy: prompt tokens of the echo + logprobs request (0: skip)")
flags.DEFINE_integer("num_tools", 128, "heavy: tools of the tool_choice=required chat (0: skip)")
flags.DEFINE_integer("slow_sockets", 50, "slowloris: sockets per kind (head, body)")
flags.DEFINE_integer("disconnects", 30, "disconnect: dropped streams (and as many timed-out plain requests)")
flags.DEFINE_integer("sigterm_streams", 8, "sigterm: streams in flight at the signal")
flags.DEFINE_float("timeout_s", 600.0, "client timeout per request (beyond it: a hang)")
flags.DEFINE_float("startup_timeout_s", 1800.0, "how long the server may take to report healthy")
flags.DEFINE_string("out", None, "write the JSON summary here too")
CATEGORIES = ("malformed", "heavy", "auth", "slowloris", "burst", "disconnect", "sigterm")
flags.DEFINE_multi_enum("categories", list(CATEGORIES), CATEGORIES, "categories to run, in the order above")


class Tally:
    """Outcomes of one category."""

    def __init__(self):
        self.counts = collections.Counter()
        self.notes: list[str] = []

    def status(self, code: int, what: str = "") -> None:
        self.counts["tried"] += 1
        kind = "503" if code == 503 else f"{code // 100}xx"
        self.counts[kind] += 1
        if code >= 500 and code != 503:
            self.notes.append(f"{code} {what}"[:200])

    def other(self, kind: str, what: str) -> None:
        self.counts["tried"] += 1
        self.counts[kind] += 1
        self.notes.append(f"{kind}: {what}"[:200])


class Audit:
    def __init__(self, url: str, key: str, pid: int):
        self.url, self.key, self.proc = url, key, psutil.Process(pid)
        self.tallies: dict[str, Tally] = collections.defaultdict(Tally)
        self.figures: dict[str, float] = {}
        self.port = int(url.rsplit(":", 1)[1])

    def headers(self, **extra) -> dict:
        return {"Authorization": f"Bearer {self.key}"} | extra

    async def post(self, client, tally: Tally, path: str, what: str, **kw) -> httpx.Response | None:
        try:
            r = await client.post(self.url + path, timeout=FLAGS.timeout_s, **kw)
        except httpx.TimeoutException:
            tally.other("hangs", what)
            return None
        except httpx.HTTPError as e:
            tally.other("lost", f"{what}: {type(e).__name__}")
            return None
        tally.status(r.status_code, f"{what}: {r.text[:120]}")
        return r

    def raw(self, data: bytes, timeout: float = 10.0) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(data)
            s.settimeout(timeout)
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except (TimeoutError, ConnectionResetError):
                pass
            return out


def _completion(**kw) -> dict:
    return {"model": FLAGS.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0} | kw


def _chat(**kw) -> dict:
    return {"model": FLAGS.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} | kw


def malformed_bodies() -> list[tuple[str, bytes, dict]]:
    """(name, raw body, extra headers) of requests that must get a 4xx."""
    j = lambda obj: json.dumps(obj).encode()  # noqa: E731
    cases = [
        ("empty body", b"", {}),
        ("not json", b"hello", {}),
        ("truncated json", b'{"model": ', {}),
        ("bad utf-8", b'{"model": "m", "prompt": "\xff\xfe"}', {}),
        ("deep nesting", b"[" * 100_000, {}),
        ("json array", b"[1, 2]", {}),
        ("integer of 5000 digits", b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}),
        ("negative 4400-digit token id", b'{"model": "m", "prompt": [-' + b"1" * 4400 + b"]}", {}),
        ("NaN temperature", b'{"model": "m", "prompt": "x", "temperature": NaN}', {}),
        ("Infinity top_p", b'{"model": "m", "prompt": "x", "top_p": Infinity}', {}),
        ("text/plain", j(_completion()), {"Content-Type": "text/plain"}),
        ("form body", j(_completion()), {"Content-Type": "application/x-www-form-urlencoded"}),
        ("prompt over max_model_len", j(_completion(prompt="hello " * 40_000)), {}),
        ("token ids out of range", j(_completion(prompt=[10**9, -1])), {}),
        ("float token ids", j(_completion(prompt=[1.5])), {}),
        ("unknown field", j(_completion(frobnicate=1)), {}),
        ("stream as string", j(_completion(stream="yes")), {}),
        ("n too large", j(_completion(n=10**6)), {}),
        ("best_of below n", j(_completion(n=3, best_of=2)), {}),
        ("max_tokens 0 without echo", j(_completion(max_tokens=0)), {}),
        ("lone surrogate", b'{"model": "m", "prompt": "\\udc80"}', {}),
        ("wrong model", j(_completion(model="gpt-4")), {}),
        ("chat without messages", j({"model": FLAGS.model_name, "messages": []}), {}),
        ("chat null content", j(_chat(messages=[{"role": "user", "content": None}])), {}),
        ("tool message without id", j(_chat(messages=[{"role": "tool", "content": "x"}])), {}),
        ("bad regex", j(_completion(guided_regex="(")), {}),
        ("bad json schema", j(_completion(response_format={"type": "json_schema"})), {}),
    ]
    for key in ("\u00b2", "\u00b9", "\u0663", "1" * 5000, "-1", "1e3", "", " "):
        cases.append((f"logit_bias key {key[:8]!r}", j(_completion(logit_bias={key: 1.0})), {}))
    for field in ("temperature", "top_p", "seed", "top_k", "min_p", "n", "max_tokens", "logprobs", "min_tokens"):
        for value in (-(10**30), 10**30, -1.5, "1", [], {}):
            if field == "top_k" and value == 10**30:
                continue  # valid: a top_k beyond the vocabulary is off
            cases.append((f"{field}={str(value)[:10]}", j(_completion(**{field: value})), {}))
    return cases


async def run_malformed(a: Audit) -> None:
    t = a.tallies["malformed"]
    async with httpx.AsyncClient() as client:
        for name, body, extra in malformed_bodies():
            headers = a.headers(**({"Content-Type": "application/json"} | extra))
            r = await a.post(client, t, "/v1/completions" if "chat" not in name else "/v1/chat/completions", name,
                             content=body, headers=headers)  # fmt: skip
            if r is not None and r.status_code < 400:
                t.notes.append(f"{r.status_code} for {name}")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + a.key.encode()
    body = json.dumps(_completion(max_tokens=1)).encode()
    smuggle = head + b"\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
    smuggle += f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = await asyncio.to_thread(a.raw, smuggle)
    code = int(reply[9:12]) if reply[:5] == b"HTTP/" else 0
    t.status(code, "content-length with transfer-encoding") if code else t.other("lost", "CL+TE: no reply")
    if reply.count(b"HTTP/1.1 ") > 1:
        t.notes.append("CL+TE: the pipelined request after it was served")
    # A body over the cap, announced by Content-Length: the 413 comes before the body is read (a client still
    # writing 17 MiB would see its write fail, so the head and one byte are sent).
    big = head + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(17 << 20).encode() + b"\r\n\r\n{"
    reply = await asyncio.to_thread(a.raw, big)
    code = int(reply[9:12]) if reply[:5] == b"HTTP/" else 0
    t.status(code, "body over the size cap") if code else t.other("lost", "body over the cap: no reply")


async def _short_latency(a: Audit, client, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.post(a.url + "/v1/completions", json=_completion(max_tokens=4), headers=a.headers(),
                              timeout=FLAGS.timeout_s)  # fmt: skip
        if r.status_code == 200:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else float("nan")


def _tools(n: int) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Looks up record {i} of the inventory by its identifier and returns its fields.",
                "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
            },
        }
        for i in range(n)
    ]


async def _token_ids(a: Audit, client, n: int) -> list[int]:
    """n token ids of English-like text (through /tokenize)."""
    rng = random.Random(n)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo"]
    text = " ".join(rng.choice(words) for _ in range(n))
    r = await client.post(a.url + "/tokenize", json={"prompt": text}, headers=a.headers(), timeout=60)
    return r.json()["tokens"][:n]


async def run_heavy(a: Audit) -> None:
    t = a.tallies["heavy"]
    cases = []
    async with httpx.AsyncClient() as client:
        if FLAGS.long_prompt_tokens:
            ids = await _token_ids(a, client, FLAGS.long_prompt_tokens)
            cases.append(("long prompt", "/v1/completions", _completion(prompt=ids, max_tokens=8)))
        if FLAGS.echo_tokens:
            ids = await _token_ids(a, client, FLAGS.echo_tokens)
            body = _completion(prompt=ids, max_tokens=0, echo=True, logprobs=5)
            cases.append(("echo + logprobs", "/v1/completions", body))
    if FLAGS.num_tools:
        body = _chat(tools=_tools(FLAGS.num_tools), tool_choice="required", max_tokens=32)
        cases.append(("128 tools, required", "/v1/chat/completions", body))
    async with httpx.AsyncClient() as client:
        idle = await _short_latency(a, client, 5)
        a.figures["short_idle_s"] = idle
        for name, path, body in cases:
            key = name.split(",")[0].replace(" + ", "_").replace(" ", "_")
            a.figures.update(await _beside(a, client, t, name, path, body, key))


async def _beside(a: Audit, client, t: Tally, name: str, path: str, body: dict, key: str) -> dict[str, float]:
    """Sends one heavy request and, while it runs, short requests one after another: the heavy one's latency,
    the short ones' count, median and worst latency, and the server's RSS growth (at the end and at its peak)."""
    rss0 = peak = a.proc.memory_info().rss
    t0 = time.perf_counter()
    heavy = asyncio.ensure_future(a.post(client, t, path, name, json=body, headers=a.headers()))
    await asyncio.sleep(1.0)
    beside = []
    while not heavy.done():
        beside.append(await _short_latency(a, client, 1))
        peak = max(peak, a.proc.memory_info().rss)
    r = await heavy
    if r is not None and r.status_code != 200:
        t.notes.append(f"{name}: {r.status_code} {r.text[:150]}")
    answered = [x for x in beside if x == x]  # NaN: the short request got no 200
    return {
        f"{key}_s": time.perf_counter() - t0,
        f"{key}_short_beside_n": len(answered),
        f"{key}_short_beside_failed": len(beside) - len(answered),
        f"{key}_short_beside_s": statistics.median(answered) if answered else float("nan"),
        f"{key}_short_beside_max_s": max(answered, default=float("nan")),
        f"{key}_rss_growth_mib": (a.proc.memory_info().rss - rss0) / 2**20,
        f"{key}_rss_peak_growth_mib": (max(peak, a.proc.memory_info().rss) - rss0) / 2**20,
    }


async def run_auth(a: Audit) -> None:
    t = a.tallies["auth"]
    variants = {
        "missing": {},
        "wrong key": {"Authorization": "Bearer nope"},
        "no scheme": {"Authorization": a.key},
        "basic scheme": {"Authorization": f"Basic {a.key}"},
        "empty bearer": {"Authorization": "Bearer"},
        "key prefix": {"Authorization": f"Bearer {a.key[:-1]}"},
        "key plus one": {"Authorization": f"Bearer {a.key}x"},
        "huge header": {"Authorization": "Bearer " + "k" * 60_000},
        "non-ascii": {"Authorization": "Bearer \u00e9\u00e9"},
        "lowercase scheme (valid)": {"Authorization": f"bearer {a.key}"},
        "right key": {"Authorization": f"Bearer {a.key}"},
    }
    routes = [
        ("POST", "/v1/completions", _completion(max_tokens=1)),
        ("POST", "/v1/chat/completions", _chat(max_tokens=1)),
        ("GET", "/v1/models", None),
        ("GET", "/tokenizer_info", None),
    ]
    async with httpx.AsyncClient() as client:
        for name, headers in variants.items():
            for method, path, body in routes:
                what = f"{name} {method} {path}"
                try:
                    h = {k: v.encode("utf-8") for k, v in headers.items()}
                    r = await client.request(method, a.url + path, json=body, headers=h, timeout=FLAGS.timeout_s)
                except httpx.HTTPError as e:
                    t.other("lost", f"{what}: {type(e).__name__}")
                    continue
                t.status(r.status_code, what)
                valid = name in ("right key", "lowercase scheme (valid)")
                if (r.status_code < 300) != valid or (not valid and r.status_code not in (400, 401, 431)):
                    t.notes.append(f"{what}: {r.status_code}")


def _slow_socket(a: Audit, kind: str, bound_s: float) -> str:
    """Trickles a request head (kind 'head') or body ('body') a byte per second; returns how it ended."""
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {a.key}\r\n".encode()
    body_head = head + b"Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", a.port)) as s:
        s.sendall(head if kind == "head" else body_head)
        s.settimeout(1.0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound_s + 10:
            try:
                s.sendall(b"X-Slow: 1\r\n" if kind == "head" else b" ")
                data = s.recv(4096)
                return "closed" if not data else data[9:12].decode(errors="replace")
            except TimeoutError:
                continue
            except OSError:
                return "closed"
        return "open"


async def run_slowloris(a: Audit) -> None:
    t = a.tallies["slowloris"]
    bounds = {"head": FLAGS.header_timeout_s, "body": 4 * FLAGS.body_timeout_s}
    kinds = [kind for kind in bounds for _ in range(FLAGS.slow_sockets)]
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:  # one thread per socket: all trickle at once
        outcomes = await asyncio.gather(*(loop.run_in_executor(pool, _slow_socket, a, k, bounds[k]) for k in kinds))
    for kind, outcome in zip(kinds, outcomes):
        if outcome == "open":
            t.other("hangs", f"slow {kind} socket still open past its bound")
        elif outcome.isdigit():
            t.status(int(outcome), f"slow {kind}")
        else:
            t.counts["tried"] += 1
            t.counts["closed"] += 1


async def run_burst(a: Audit) -> None:
    t = a.tallies["burst"]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        n = 4 * FLAGS.max_queue
        results = await asyncio.gather(
            *(
                a.post(client, t, "/v1/completions", f"burst {i}", json=_completion(max_tokens=8), headers=a.headers())
                for i in range(n)
            )  # fmt: skip
        )
    for r in results:
        if r is not None and r.status_code == 503 and "retry-after" not in r.headers:
            t.notes.append("503 without Retry-After")


async def _drop_stream(a: Audit, client, t: Tally) -> None:
    t.counts["tried"] += 1
    body = _completion(max_tokens=200, stream=True, ignore_eos=True)
    try:
        async with client.stream("POST", a.url + "/v1/completions", json=body, headers=a.headers(),
                                 timeout=FLAGS.timeout_s) as r:  # fmt: skip
            async for _ in sse_chunks(r):
                break  # hang up after the first chunk
        t.counts["dropped"] += 1
    except Exception as e:  # noqa: BLE001 - counted
        t.other("lost", f"stream: {type(e).__name__}: {e}")


async def run_disconnect(a: Audit) -> None:
    t = a.tallies["disconnect"]
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(_drop_stream(a, client, t) for _ in range(FLAGS.disconnects)))
        for _ in range(FLAGS.disconnects):
            t.counts["tried"] += 1
            try:
                body = _completion(max_tokens=200, ignore_eos=True)
                await client.post(a.url + "/v1/completions", json=body, headers=a.headers(), timeout=0.3)
                t.counts["2xx"] += 1
            except httpx.TimeoutException:
                t.counts["dropped"] += 1
    deadline = time.monotonic() + 120
    while True:
        m = read_metrics(a.url)
        idle = m.get("pallas_serve_running_sequences", 0) == 0 and m.get("pallas_serve_queue_length", 0) == 0
        if idle and m.get("pallas_serve_kv_blocks_in_requests", 0) == 0:
            break
        if time.monotonic() > deadline:
            t.other("lost", f"not idle 120 s after the disconnects: {m}")
            break
        await asyncio.sleep(0.5)


async def _sigterm_stream(a: Audit, client, t: Tally) -> None:
    body = _completion(max_tokens=2000, stream=True, ignore_eos=True)
    try:
        async with client.stream("POST", a.url + "/v1/completions", json=body, headers=a.headers(),
                                 timeout=FLAGS.timeout_s) as r:  # fmt: skip
            async for _ in sse_chunks(r):
                pass
        t.status(200, "stream completed")
    except Exception as e:  # noqa: BLE001 - an error event saying the server shuts down is the expected end
        if "server_shutting_down" in str(e):
            t.status(503, "stream ended by the drain deadline")
        else:
            t.other("lost", f"stream at SIGTERM: {type(e).__name__}: {e}")


async def run_sigterm(a: Audit, server) -> None:
    t = a.tallies["sigterm"]
    async with httpx.AsyncClient() as client:
        streams = [asyncio.ensure_future(_sigterm_stream(a, client, t)) for _ in range(FLAGS.sigterm_streams)]
        await asyncio.sleep(3.0)
        t0 = time.monotonic()
        status = await asyncio.to_thread(stop_server, server, FLAGS.drain_timeout_s + 60)
        a.figures["sigterm_exit_s"] = time.monotonic() - t0
        a.figures["sigterm_exit_status"] = status if isinstance(status, int) else -1
        await asyncio.gather(*streams)
    if status != 0 or a.figures["sigterm_exit_s"] > FLAGS.drain_timeout_s + 10:
        t.other("lost", f"exit status {status} after {a.figures['sigterm_exit_s']:.1f} s")


async def audit(a: Audit, server) -> dict:
    a.figures["rss_before_mib"] = a.proc.memory_info().rss / 2**20
    for name, step in (("malformed", run_malformed), ("heavy", run_heavy), ("auth", run_auth),
                       ("slowloris", run_slowloris), ("burst", run_burst), ("disconnect", run_disconnect)):  # fmt: skip
        if name not in FLAGS.categories:
            continue
        t0 = time.perf_counter()
        await step(a)
        a.figures[f"{name}_s"] = time.perf_counter() - t0
        print(f"{name}: {dict(a.tallies[name].counts)} ({a.figures[f'{name}_s']:.0f} s)", file=sys.stderr)
    m = read_metrics(a.url)
    a.figures["rss_after_mib"] = a.proc.memory_info().rss / 2**20
    a.figures["engine_thread_compiles"] = m.get("pallas_serve_engine_thread_compiles_total", -1)
    if "sigterm" in FLAGS.categories:
        await run_sigterm(a, server)
    total = collections.Counter()
    for tally in a.tallies.values():
        total.update(tally.counts)
    return {
        "total": dict(total),
        "categories": {k: dict(v.counts) for k, v in a.tallies.items()},
        "figures": {k: round(v, 3) for k, v in a.figures.items()},
        "problems": [n for v in a.tallies.values() for n in v.notes],
    }


def main(argv) -> int:
    key = secrets.token_hex(16)
    port = free_port()
    server_args = [
        "--api_key", key, "--max_queue", str(FLAGS.max_queue), "--drain_timeout_s", str(FLAGS.drain_timeout_s),
        "--body_timeout_s", str(FLAGS.body_timeout_s), "--header_timeout_s", str(FLAGS.header_timeout_s),
        *argv[1:],
    ]  # fmt: skip
    server = start_server(port, server_args)
    url = f"http://127.0.0.1:{port}"
    try:
        a = Audit(url, key, server.pid)
        a.figures["startup_s"] = wait_healthy(url, server, FLAGS.startup_timeout_s)
        summary = asyncio.run(audit(a, server))
    finally:
        stop_server(server, 30)
    text = json.dumps(summary, indent=2)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text + "\n")
    t = summary["total"]
    return 1 if t.get("5xx", 0) or t.get("hangs", 0) or t.get("lost", 0) else 0


if __name__ == "__main__":
    app.run(main)
