"""The serving benchmark (benchmarks/bench.py --mode serving, benchmarks/bench_serving.py) against a live server, and the
progress callback of LLM.generate.

One server subprocess (the real binary on a loopback port) serves the whole module; its engine options are small
so that CPU start-up stays short. The progress test runs a random tiny model in-process.
"""

import io
import json
import math
import os
import subprocess
import sys
import time

import pytest

from benchmarks import bench_serving as bs
from benchmarks import local_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pallas-serve", "xla-tests")
MAX_MODEL_LEN = 512
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, attention_backend="xla", decode_steps=1)
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--max_model_len", str(MAX_MODEL_LEN), "--compilation_cache_dir", CACHE_DIR]
    for k, v in ENGINE.items():
        flags += [f"--{k}", str(v)]
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    port = local_server.free_port()
    proc = local_server.start_server(port, flags, stdout=log)
    url = f"http://127.0.0.1:{port}"
    try:
        local_server.wait_healthy(url, proc, timeout=900)
    except RuntimeError:
        local_server.stop_server(proc, timeout=10)
        log.seek(0)
        pytest.fail(f"server did not start:\n{log.read()[-3000:]}")
    yield url
    assert local_server.stop_server(proc) == 0
    log.close()


def _check_consistent(r: dict) -> None:
    """Every metric is present and the counts and times agree with each other."""
    for key in (
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
    ):
        assert r[key] is not None, key
    for name in METRICS:
        assert set(r[name]) == {"mean", "p50", "p90", "p99", "max"}, name
        if r["completed"]:
            assert r[name]["p50"] <= r[name]["p90"] <= r[name]["p99"] <= r[name]["max"], name
    assert r["sent"] == r["completed"] + r["failed"] + r["cut_by_duration"]
    assert r["planned"] == r["sent"] + r["not_sent"]
    done = [q for q in r["per_request"] if q["ok"]]
    assert len(done) == r["completed"]
    assert sum(q["output_tokens"] for q in done) == r["total_output_tokens"]
    assert sum(q["prompt_tokens"] for q in done) == r["total_input_tokens"]
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    for q in done:
        assert 0 < q["ttft_s"] <= q["latency_s"]
        assert q["sent_s"] + q["latency_s"] <= r["duration_s"] + 1e-6
        assert len(q["chunk_gaps_s"]) <= q["output_tokens"] - 1
    assert r["goodput"] is None or r["goodput"]["good_requests"] <= r["completed"]


def test_binary_fixed_lengths_exact_with_ignore_eos(server, tmp_path):
    """The absl binary against a running server: JSON and PNG written, every metric, exact output lengths."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench",
        "--mode",
        "serving",
        "--base_url",
        server,
        "--dataset",
        "fixed",
        "--input_len",
        "24",
        "--output_len",
        "6",
        "--num_requests",
        "12",
        "--request_rate",
        "8",
        "--slo_ttft_ms",
        "60000",
        "--slo_tpot_ms",
        "60000",
        "--duration_s",
        "600",
        "--out_dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stem = tmp_path / "serving_smollm2_135m_instruct"
    record = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".png").stat().st_size > 10_000
    assert record["mode"] == "serving" and record["model"] == "SmolLM2-135M-Instruct" and record["device"]
    r = record["results"]
    _check_consistent(r)
    assert (r["planned"], r["completed"], r["failed"]) == (12, 12, 0)
    assert r["output_len_mismatches"] == 0
    assert [q["output_tokens"] for q in r["per_request"]] == [6] * 12
    assert r["total_input_tokens"] == 12 * 24
    # Generous SLOs: every request is good, so goodput is the request throughput.
    assert r["goodput"]["good_requests"] == 12
    assert r["goodput"]["request_throughput"] == pytest.approx(r["request_throughput"])


def test_jsonl_workload_under_max_concurrency(server, tmp_path):
    """Text prompts from JSONL with per-line max_tokens; never more than max_concurrency requests in flight."""
    lines = [
        {"prompt": "The capital of France is", "max_tokens": 5},
        {"prompt": "def fibonacci(n):"},
        {"prompt": "Three primary colours are", "max_tokens": 3},
        {"prompt": "Once upon a time", "max_tokens": 7},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = bs.read_jsonl(str(path), 10, default_max_tokens=4)
    assert [q.max_tokens for q in requests] == [5, 4, 3, 7]
    cfg = bs.ServingBenchConfig(server, num_requests=10, max_concurrency=2, slo_ttft_ms=60000)
    r = bs.run(cfg, requests)
    _check_consistent(r)
    assert (r["planned"], r["completed"]) == (4, 4)
    assert [q["output_tokens"] for q in r["per_request"]] == [5, 4, 3, 7]
    spans = [(q["sent_s"], q["sent_s"] + q["latency_s"]) for q in r["per_request"]]
    for start, _ in spans:
        assert sum(s <= start < e for s, e in spans) <= 2


def test_duration_cap_cuts_and_counts_add_up(server):
    """A 1.5 s cap over long requests: the run stops by itself, cut requests are counted, nothing fails."""
    cfg = bs.ServingBenchConfig(server, num_requests=6, request_rate=20.0, duration_s=1.5)
    r = bs.run(cfg, bs.fixed_lengths(6, 0, 16, 200))
    _check_consistent(r)
    assert (r["completed"], r["failed"]) == (0, 0)
    assert r["cut_by_duration"] >= 1
    # The cut streams were closed by the client, so the server aborts them and frees their KV blocks.
    deadline = time.monotonic() + 120
    while (
        (m := local_server.read_metrics(server))["pallas_serve_running_sequences"]
        or m["pallas_serve_queue_length"]
        or m["pallas_serve_kv_blocks_in_requests"]
    ):
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert r["duration_s"] < 10
    assert r["goodput"] is None  # no SLO given


def test_refuses_non_loopback_urls():
    for url in ("http://127.0.0.1:8000", "http://localhost:1/", "http://[::1]:8000"):
        assert bs.ServingBenchConfig(url, 1).base_url == url
    for url in ("http://192.0.2.1:8000", "http://example.com", "http://127.0.0.2:80", "ftp://127.0.0.1", "x"):
        with pytest.raises(ValueError, match="refusing|not an http"):
            bs.ServingBenchConfig(url, 1)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--mode", "serving", "--base_url", "http://192.0.2.1:8000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: refusing 'http://192.0.2.1:8000': only a server on this machine's loopback interface "
        "(127.0.0.1, localhost, ::1) may be benchmarked, not host '192.0.2.1'"
    ]


def test_workloads_and_bad_jsonl(tmp_path):
    a = bs.sharegpt_like(200, 7, 64, 1.0, 300, 32, 1.2, 100)
    assert a == bs.sharegpt_like(200, 7, 64, 1.0, 300, 32, 1.2, 100)
    ins, outs = [len(q.prompt) for q in a], [q.max_tokens for q in a]
    assert min(ins) >= 4 and max(ins) == 300 and min(outs) >= 1 and max(outs) == 100  # heavy tails are clipped
    assert 40 < sorted(ins)[100] < 100 and 20 < sorted(outs)[100] < 50  # medians near the requested ones
    assert all(bs.TOKEN_ID_RANGE[0] <= t < bs.TOKEN_ID_RANGE[1] for q in a for t in q.prompt)
    assert {(len(q.prompt), q.max_tokens) for q in bs.fixed_lengths(5, 0, 9, 3)} == {(9, 3)}
    bad = tmp_path / "bad.jsonl"
    for text, needle in (
        ('{"prompt": "a"}\n{"prompt": 3}\n', "bad.jsonl:2: expected"),
        ('{"prompt": "a", "max_tokens": 0}\n', "bad.jsonl:1: max_tokens"),
        ("{nope\n", "bad.jsonl:1: not valid JSON"),
        ("\n", "no requests"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle):
            bs.read_jsonl(str(bad), 10, 4)


def test_summarize_goodput_and_cut_requests():
    """Exact figures from made-up results: TPOT excludes the first token, goodput needs both SLOs."""

    def res(ttft, latency, n, gaps=(), asked=None):
        return bs.RequestResult(
            asked or n,
            ok=True,
            ttft_s=ttft,
            latency_s=latency,
            prompt_tokens=10,
            output_tokens=n,
            chunk_gaps_s=list(gaps),
        )

    results = [
        res(0.1, 1.1, 11, [0.1] * 10),
        res(0.5, 0.7, 3, [0.1, 0.1]),
        res(0.2, 0.2, 1, asked=4),
        bs.RequestResult(4, error="HTTP 503"),
        bs.RequestResult(4, cut=True),
    ]
    cfg = bs.ServingBenchConfig(None, 6, slo_ttft_ms=300, slo_tpot_ms=100)
    r = bs.summarize(cfg, results, wall=2.0, planned=6)
    assert (r["sent"], r["not_sent"], r["completed"], r["failed"], r["cut_by_duration"]) == (5, 1, 3, 1, 1)
    assert r["tpot_ms"]["mean"] == pytest.approx(100.0)  # (1.0 / 10 and 0.2 / 2) s per token
    assert r["itl_ms"]["p50"] == pytest.approx(100.0)
    assert r["ttft_ms"]["max"] == pytest.approx(500.0)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 15)
    assert r["output_throughput"] == 7.5 and r["total_token_throughput"] == 22.5 and r["request_throughput"] == 1.5
    assert r["goodput"]["good_requests"] == 2  # the 500 ms TTFT misses; the 1-token output has no TPOT to miss
    assert r["failure_samples"] == ["HTTP 503"]
    assert r["output_len_mismatches"] == 1  # 1 token where 4 were asked
    assert math.isclose(r["tokens_per_chunk"], 15 / 15)


def test_llm_generate_progress_callback():
    """Called after every step, monotone, ending at (total, total, all tokens); the generate binary's bar. The
    callback is the engine loop's, whatever the model: a random tiny one (a second SmolLM2 in this process only
    loaded and compiled it again; a CPU host has no persistent cache to share the server's steps)."""
    import jax.numpy as jnp

    from model.config import ModelConfig
    from model.transformer import random_model
    from serving.engine.llm import LLM
    from serving.progress import Progress

    llm = LLM.from_model(random_model(ModelConfig.tiny(), jnp.float32, seed=0), None, max_model_len=64, **ENGINE)
    calls = []
    outs = llm.generate(
        [[5], [6, 7, 8, 9, 10], [11, 12, 13]],
        max_tokens=5,
        ignore_eos=True,
        progress=lambda *a: calls.append(a),
    )
    assert len(calls) >= 5
    assert all(total == 3 for _, total, _ in calls)
    assert all(a[0] <= b[0] and a[2] <= b[2] for a, b in zip(calls, calls[1:]))
    assert calls[-1] == (3, 3, sum(len(o.token_ids) for o in outs)) == (3, 3, 15)

    bar = Progress("warm-up")
    bar._tqdm = None  # the fallback line, as without tqdm installed
    err = io.StringIO()
    stderr, sys.stderr = sys.stderr, err
    try:
        bar(1, 3, 10)
        bar(3, 3, 15)
        bar.close()
    finally:
        sys.stderr = stderr
    assert "warm-up: generated 1/3 prompts, 10 tokens" in err.getvalue()
    assert err.getvalue().rstrip().split("\r")[-1].startswith("warm-up: generated 3/3 prompts, 15 tokens")
