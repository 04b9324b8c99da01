"""Online serving benchmark over HTTP (the `serving` mode of benchmarks/bench.py), after vLLM's benchmark_serving.

    workload (ShareGPT-like / fixed / JSONL) --> arrivals (Poisson at a rate, or all at once)
        --> [at most max_concurrency in flight] --> streaming POST /v1/completions per request
        --> per request: time of every stream chunk, token counts from the final usage chunk
        --> throughput, TTFT / TPOT / ITL / end-to-end percentiles, goodput under an SLO

Synthetic prompts are random token ids sent as a token list (the completions API accepts one), so input lengths
are exact; `ignore_eos` (vLLM's extension, which the server honours) makes output lengths exact too. Greedy
decoding. Definitions, per completed request:
  TTFT  send -> first stream chunk that carries a choice.
  TPOT  (end-to-end - TTFT) / (output tokens - 1): the mean time per output token after the first.
  ITL   gaps between successive chunks. A chunk carries one token, or several when the server decodes several
        steps on device in one go (its --decode_steps), so ITL can exceed TPOT by that factor.
  goodput  completed requests per second whose TTFT and TPOT both meet the SLO (a one-token output meets any
        TPOT SLO).
Throughputs divide by the wall time from the first send to the last completion (or the duration cap).

Bounded: at most `num_requests` are sent, none after `duration_s`, and requests still in flight at `duration_s`
are cancelled and counted as `cut_by_duration`, so sent = completed + failed + cut_by_duration. Only loopback
servers are accepted (benchmarks.local_server.check_loopback_url).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import subprocess
import time

import httpx
import numpy as np

from benchmarks import local_server
from benchmarks.local_server import StreamError, check_loopback_url, read_metrics, sse_chunks

# Random prompt ids are drawn from here: above the special tokens of common vocabularies, below their sizes.
TOKEN_ID_RANGE = (100, 30000)


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: text or token ids, and the number of tokens to generate."""

    prompt: str | list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class ServingBenchConfig:
    """How to drive the server (see the module docstring).

    request_rate: mean requests per second of the Poisson arrivals; math.inf sends all at once.
    max_concurrency: most requests in flight (None: unbounded); arrivals beyond it wait their turn.
    slo_ttft_ms, slo_tpot_ms: the goodput SLO (None: that bound is not checked; both None: no goodput).
    """

    base_url: str | None  # None: bench() starts a server on a free loopback port
    num_requests: int
    request_rate: float = math.inf
    max_concurrency: int | None = None
    duration_s: float = 600.0
    ignore_eos: bool = True
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_timeout_s: float = 600.0
    seed: int = 0
    api_key: str | None = None

    def __post_init__(self):
        if self.base_url is not None:
            check_loopback_url(self.base_url)
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_requests < 1 or not self.duration_s > 0:
            raise ValueError("num_requests must be >= 1 and duration_s > 0")


# Workloads ---------------------------------------------------------------------------------------------------------


def _random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(*TOKEN_ID_RANGE, n).tolist()


def _lognormal(rng: np.random.Generator, n: int, median: int, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(np.exp(rng.normal(np.log(median), sigma, n))), lo, hi).astype(int)


def sharegpt_like(
    n: int,
    seed: int,
    input_median: int,
    input_sigma: float,
    input_max: int,
    output_median: int,
    output_sigma: float,
    output_max: int,
) -> list[BenchRequest]:
    """ShareGPT-like lengths: log-normal input and output lengths (heavy right tail), clipped to [4, input_max]
    and [1, output_max], over random token ids."""
    rng = np.random.default_rng(seed)
    ins = _lognormal(rng, n, input_median, input_sigma, min(4, input_max), input_max)
    outs = _lognormal(rng, n, output_median, output_sigma, 1, output_max)
    return [BenchRequest(_random_ids(rng, int(i)), int(o)) for i, o in zip(ins, outs)]


def fixed_lengths(n: int, seed: int, input_len: int, output_len: int) -> list[BenchRequest]:
    """Every request has input_len random prompt tokens and asks for output_len tokens."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(_random_ids(rng, input_len), output_len) for _ in range(n)]


def read_jsonl(path: str, n: int, default_max_tokens: int) -> list[BenchRequest]:
    """The first n lines of a JSONL file of {"prompt": str or [token ids], "max_tokens": int (optional)}.

    Raises ValueError naming the file and line of the first bad entry.
    """
    out: list[BenchRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if len(out) == n:
                    break
                if line.strip():
                    out.append(_parse_line(line, f"{path}:{no}", default_max_tokens))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def _parse_line(line: str, where: str, default_max_tokens: int) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
    prompt = item.get("prompt") if isinstance(item, dict) else None
    ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    if not ((isinstance(prompt, str) and prompt) or ids_ok):
        raise ValueError(f'{where}: expected {{"prompt": non-empty str or token ids, "max_tokens": int}}')
    max_tokens = item.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    return BenchRequest(prompt, max_tokens)


# Driving the server ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds; `sent_s` is from the benchmark's start."""

    max_tokens: int
    sent_s: float = 0.0
    ok: bool = False
    cut: bool = False  # still in flight (or waiting for a slot) at the duration cap
    latency_s: float = 0.0
    ttft_s: float | None = None
    chunk_gaps_s: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


async def _stream_one(client: httpx.AsyncClient, body: dict, res: RequestResult) -> None:
    """Sends one streaming completion and fills `res` (ok only after finish_reason, usage and [DONE])."""
    t0 = time.perf_counter()
    last, finished, done = None, False, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        try:
            async for chunk in sse_chunks(r):
                if chunk is None:
                    done = True
                    break
                now = time.perf_counter()
                if chunk.get("choices"):
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.chunk_gaps_s.append(now - last)
                    last = now
                    finished |= any(c.get("finish_reason") for c in chunk["choices"])
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        except StreamError as e:
            res.error = str(e)
            return
    res.latency_s = time.perf_counter() - t0
    res.ok = done and finished and res.ttft_s is not None
    if not res.ok:
        res.error = f"incomplete stream (done={done}, finished={finished}, first chunk={res.ttft_s is not None})"


def _body(model: str, req: BenchRequest, ignore_eos: bool) -> dict:
    return {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }


async def _one(client, sem, body: dict, res: RequestResult, t_start: float) -> None:
    async with sem:
        res.sent_s = time.perf_counter() - t_start
        try:
            await _stream_one(client, body, res)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            res.error = f"{type(e).__name__}: {e}"


async def _drive(cfg: ServingBenchConfig, model: str, requests: list[BenchRequest]):
    """Sends the requests on their arrival schedule; returns (results of those sent, wall seconds)."""
    rng = np.random.default_rng(cfg.seed + 1)
    sem = asyncio.Semaphore(cfg.max_concurrency or len(requests))
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, timeout=cfg.request_timeout_s, limits=limits, headers=_auth(cfg)
    ) as client:
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration_s
        due, tasks, results = t0, [], []
        for i, req in enumerate(requests):
            if i and math.isfinite(cfg.request_rate):
                due += rng.exponential(1.0 / cfg.request_rate)
                await asyncio.sleep(max(0.0, min(due, deadline) - time.perf_counter()))
            if time.perf_counter() >= deadline:
                break
            results.append(RequestResult(req.max_tokens))
            tasks.append(asyncio.create_task(_one(client, sem, _body(model, req, cfg.ignore_eos), results[-1], t0)))
        pending = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    for task, res in zip(tasks, results):
        if task in pending:
            res.ok, res.cut, res.error = False, True, f"still running at the {cfg.duration_s:g} s duration cap"
    return results, wall


def _auth(cfg: ServingBenchConfig) -> dict:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def served_model(cfg: ServingBenchConfig) -> str:
    """The model name the server expects (the first entry of /v1/models)."""
    r = httpx.get(cfg.base_url + "/v1/models", headers=_auth(cfg), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run(cfg: ServingBenchConfig, requests: list[BenchRequest]) -> dict:
    """Benchmarks a healthy server with `requests` (the first cfg.num_requests); returns the results dict.

    One short unmeasured request goes first, as in vLLM, so that a broken setup fails before the clock starts.
    """
    model = served_model(cfg)
    warm = RequestResult(2)
    asyncio.run(_one_client(cfg, _body(model, BenchRequest(requests[0].prompt, 2), cfg.ignore_eos), warm))
    if not warm.ok:
        raise RuntimeError(f"the warm-up request failed: {warm.error}")
    before = read_metrics(cfg.base_url)
    results, wall = asyncio.run(_drive(cfg, model, requests[: cfg.num_requests]))
    after = read_metrics(cfg.base_url)
    summary = summarize(cfg, results, wall, min(cfg.num_requests, len(requests)))
    summary["served_model"] = model
    summary["server"] = {
        k: after.get(f"pallas_serve_{k}_total", 0.0) - before.get(f"pallas_serve_{k}_total", 0.0)
        for k in ("engine_steps", "preemptions")
    }
    summary["server"]["prefix_cache_hit_rate"] = after.get("pallas_serve_prefix_cache_hit_rate")
    return summary


def bench(
    cfg: ServingBenchConfig,
    requests: list[BenchRequest],
    server_args: list[str] = (),
    startup_timeout_s: float = 1800.0,
) -> dict:
    """`run` against cfg.base_url, or against a server started with `server_args` on a free loopback port (when
    base_url is None), which is stopped afterwards (SIGTERM; its exit status is reported)."""
    if cfg.base_url is not None:
        local_server.wait_healthy(cfg.base_url, None, startup_timeout_s)
        return run(cfg, requests) | dict(base_url=cfg.base_url)
    port = local_server.free_port()
    cfg = dataclasses.replace(cfg, base_url=f"http://127.0.0.1:{port}")
    proc = local_server.start_server(port, list(server_args))
    try:
        startup_s = local_server.wait_healthy(cfg.base_url, proc, startup_timeout_s)
        results = run(cfg, requests)
    finally:
        exit_code = local_server.stop_server(proc)
    return results | dict(
        base_url="self-started on 127.0.0.1",
        server_args=list(server_args),
        server_startup_s=startup_s,
        server_exit_code=exit_code,
    )


def host_device() -> str:
    """This machine (the server is on loopback, so on it too), without importing jax, which would claim the GPU."""
    cpu = "CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpus = ""
    return f"{cpu}, {os.cpu_count()} cores" + "".join(f"; {g}" for g in gpus.splitlines())


async def _one_client(cfg: ServingBenchConfig, body: dict, res: RequestResult) -> None:
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=cfg.request_timeout_s, headers=_auth(cfg)) as c:
        await _one(c, asyncio.Semaphore(1), body, res, time.perf_counter())


# Metrics -----------------------------------------------------------------------------------------------------------


def stats_ms(values_s: list[float]) -> dict:
    """mean / p50 / p90 / p99 / max in milliseconds (None when there are no values)."""
    if not values_s:
        return {k: None for k in ("mean", "p50", "p90", "p99", "max")}
    v = 1e3 * np.asarray(values_s, float)
    return dict(
        mean=float(v.mean()),
        p50=float(np.percentile(v, 50)),
        p90=float(np.percentile(v, 90)),
        p99=float(np.percentile(v, 99)),
        max=float(v.max()),
    )


def summarize(cfg: ServingBenchConfig, results: list[RequestResult], wall: float, planned: int) -> dict:
    """Throughputs, latency percentiles, goodput and counts (see the module docstring)."""
    done = [r for r in results if r.ok]
    n_in, n_out = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    gaps = [g for r in done for g in r.chunk_gaps_s]
    chunks = sum(len(r.chunk_gaps_s) + 1 for r in done)
    out = dict(
        planned=planned,
        sent=len(results),
        not_sent=planned - len(results),
        completed=len(done),
        failed=sum(not r.ok and not r.cut for r in results),
        cut_by_duration=sum(r.cut for r in results),
        duration_s=wall,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(done) / wall,
        output_throughput=n_out / wall,
        total_token_throughput=(n_in + n_out) / wall,
        ttft_ms=stats_ms([r.ttft_s for r in done]),
        tpot_ms=stats_ms(tpot),
        itl_ms=stats_ms(gaps),
        e2el_ms=stats_ms([r.latency_s for r in done]),
        tokens_per_chunk=n_out / chunks if chunks else None,
        output_len_mismatches=sum(r.output_tokens != r.max_tokens for r in done),
        goodput=_goodput(cfg, done, wall),
        failure_samples=[r.error for r in results if not r.ok and not r.cut][:5],
    )
    out["per_request"] = [
        dict(
            sent_s=r.sent_s,
            ok=r.ok,
            ttft_s=r.ttft_s,
            latency_s=r.latency_s,
            tpot_s=r.tpot_s,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
            max_tokens=r.max_tokens,
            chunk_gaps_s=r.chunk_gaps_s,
        )
        for r in results
    ]
    return out


def _goodput(cfg: ServingBenchConfig, done: list[RequestResult], wall: float) -> dict | None:
    if cfg.slo_ttft_ms is None and cfg.slo_tpot_ms is None:
        return None
    ttft_ok = lambda r: cfg.slo_ttft_ms is None or 1e3 * r.ttft_s <= cfg.slo_ttft_ms  # noqa: E731
    tpot_ok = lambda r: cfg.slo_tpot_ms is None or r.tpot_s is None or 1e3 * r.tpot_s <= cfg.slo_tpot_ms  # noqa: E731
    good = sum(ttft_ok(r) and tpot_ok(r) for r in done)
    return dict(
        slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms, good_requests=good, request_throughput=good / wall
    )


# Plot --------------------------------------------------------------------------------------------------------------


def plot(results: dict, path: str) -> None:
    """PNG: CDFs of TTFT, TPOT and end-to-end latency (SLO lines where set) and a histogram of ITL; milliseconds,
    or seconds for a panel whose values reach 10 s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = [r for r in results["per_request"] if r["ok"]]
    slo = results.get("goodput") or {}
    series = [
        ("TTFT", [r["ttft_s"] for r in per], slo.get("slo_ttft_ms")),
        ("TPOT", [r["tpot_s"] for r in per if r["tpot_s"] is not None], slo.get("slo_tpot_ms")),
        ("end-to-end latency", [r["latency_s"] for r in per], None),
        ("inter-chunk latency (ITL)", [g for r in per for g in r["chunk_gaps_s"]], None),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for i, (ax, (name, values, bound_ms)) in enumerate(zip(axes.flat, series)):
        v = np.sort(np.asarray(values, float))
        scale, unit = (1.0, "s") if len(v) and v[-1] >= 10 else (1e3, "ms")
        v = v * scale
        if i == 3:
            ax.hist(v, bins=40, color="tab:orange")
            ax.set_ylabel("chunks")
        elif len(v):
            ax.step(np.r_[v[0], v], np.arange(len(v) + 1) / len(v), where="post")
            ax.set_ylabel("fraction of requests")
        if bound_ms is not None:
            ax.axvline(bound_ms * scale / 1e3, color="tab:red", ls="--", label=f"SLO {bound_ms:g} ms")
            ax.legend(fontsize=8)
        ax.set_xlabel(f"{name} ({unit})")
        ax.set_title(f"{name} {'histogram' if i == 3 else 'CDF'}")
    fig.suptitle(
        f"{results['completed']}/{results['planned']} completed, {results['request_throughput']:.2f} req/s, "
        f"{results['output_throughput']:.1f} output tok/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
