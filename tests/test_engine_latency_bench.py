"""benchmarks/engine_latency.py (the engine's profile, TTFT, long-context and ITL-under-load figures): the per-step trace
summary on a synthetic GPU trace, the ITL statistics on synthetic deliveries, and every mode end to end on the
tiny preset (CPU), each writing well-formed JSON lines."""

from __future__ import annotations

import gzip
import json
import time
import types

import pytest

from benchmarks import engine_latency
from benchmarks.engine_core import device_spans, device_timeline
from serving.core.request import SamplingParams


def _write(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def _gpu_trace(tmp_path, layers: int = 2, steps: int = 3):
    """`steps` decode steps of `layers` layers on a GPU stream (per layer: a gemm 10 us, the paged kernel 4 us, a
    norm fusion 2 us, a KV scatter 1 us; then a 5 us sampler fusion and a 20 us host gap per step), a derived
    "XLA Modules" line covering everything, and a host process."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 900, "args": {"name": "XLA Modules"}},
        {"ph": "M", "name": "process_name", "pid": 700, "args": {"name": "/host:CPU"}},
    ]
    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 10.0),
        ("paged_decode_ps16_bt64_s1", 4.0),
        ("loop_rsqrt_fusion", 2.0),
        ("input_scatter_fusion", 1.0),
    ]
    events, t = [], 0.0
    for _ in range(steps):
        for _ in range(layers):
            for name, dur in kernels:
                events.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": dur, "name": name})
                t += dur
        events.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": 5.0, "name": "fusion_sample_argmax"})
        t += 5.0 + 20.0  # the host gap before the next step
    end = t - 20.0
    events.append({"ph": "X", "pid": 1, "tid": 900, "ts": 0.0, "dur": end, "name": "jit_loop"})
    events.append({"ph": "X", "pid": 700, "tid": 1, "ts": 0.0, "dur": 5000.0, "name": "python"})
    _write(tmp_path, meta + events)
    return end


def test_category_names():
    cases = {
        "paged_decode_ps16_bt64_s4": "attention",
        "ragged_paged_ps16_m64_bt64_4_rows": "attention",
        "gemm_fusion_dot_3": "matmul",  # a Triton GEMM fusion: matmul, though it is named a fusion
        "nvjet_tst_128x64_64x8_1x1_v_bz_TNT": "matmul",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16>": "matmul",
        "qmm_int8_m16_n64_k256_s1": "matmul",
        "anonymous_mosaic_gpu_kernel": "matmul",  # the streaming / W8A8 matmuls (Mosaic GPU drops their names)
        "act_quant_fp8_bm4_c4096": "elementwise",
        "fake_quant_int8_bm1_c2048": "elementwise",
        "MemcpyD2D": "copy",
        "input_scatter_fusion_2": "copy",
        "loop_multiply_fusion": "elementwise",
        "input_reduce_fusion_7": "elementwise",
        "some_unknown_kernel": "other",
    }
    assert {n: engine_latency.category(n) for n in cases} == cases


def test_step_profile_on_a_synthetic_gpu_trace(tmp_path):
    end = _gpu_trace(tmp_path, layers=2, steps=3)
    path, spans = device_spans(str(tmp_path))
    assert all(n != "jit_loop" for _, _, n in spans)  # the derived line is not a kernel
    p = engine_latency.step_profile(path, spans, num_layers=2, engine_steps=99)
    assert p["steps"] == 3 and p["steps_from"] == "trace"  # 6 paged launches / 2 layers, not the engine's 99
    ms = p["per_step_ms"]
    assert ms["matmul"] == pytest.approx(0.020)  # 2 layers x 10 us
    assert ms["attention"] == pytest.approx(0.008)
    assert ms["elementwise"] == pytest.approx(0.009)  # norms 2 x 2 us + the sampler's 5 us
    assert ms["copy"] == pytest.approx(0.002)
    assert ms["host_gap"] == pytest.approx(0.040 / 3, abs=1e-4)  # two 20 us gaps inside the span, over 3 steps
    assert p["step_ms"] == pytest.approx(end / 1e3 / 3, abs=1e-4)
    assert sum(p["pct_of_span"].values()) == pytest.approx(100.0, abs=0.1)  # one stream: nothing overlaps
    assert p["top_kernels"][0]["name"].startswith("sm90_xmma_gemm")
    assert p["top_kernels"][0]["launches_per_step"] == 2


def test_engine_core_timeline_skips_derived_lines(tmp_path):
    _gpu_trace(tmp_path, layers=1, steps=2)
    t = device_timeline(str(tmp_path))
    assert t["gaps"] == 1 and t["gap_ms_total"] == pytest.approx(0.020)  # the XLA Modules event would hide it


def test_steps_fall_back_to_the_engine_count(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    _write(tmp_path, meta + [{"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 8.0, "name": "fusion"}])
    p = engine_latency.step_profile(*device_spans(str(tmp_path)), num_layers=32, engine_steps=4)
    assert p["steps_from"] == "engine" and p["per_step_ms"]["elementwise"] == pytest.approx(0.002)


def test_itl_stats_count_each_token_of_a_delivery():
    # Request a: first token at 1.0, then 4 tokens 0.4 s later, then 1 token 0.1 s later. b arrives outside.
    recs = {"a": (0.5, [(1.0, 1), (1.4, 4), (1.5, 1)]), "b": (9.0, [(9.5, 1), (9.6, 1)])}
    s = engine_latency._itl_stats(recs, 0.0, 5.0)
    assert s["requests"] == 1 and s["deliveries"] == 2 and s["tokens_per_delivery"] == 2.5
    assert s["ttft_p50_ms"] == pytest.approx(500.0)
    assert s["itl_delivery_p50_ms"] == pytest.approx(250.0)  # gaps 400 and 100 ms
    assert s["itl_token_p50_ms"] == pytest.approx(100.0)  # per token: 100, 100, 100, 100 (the 4) and 100
    early = engine_latency._itl_stats(recs, 0.0, 1.45)  # the window is by delivery time: the 1.5 s delivery is after it
    assert early["deliveries"] == 1 and early["itl_token_p50_ms"] == pytest.approx(100.0)
    recs["a"] = (0.5, [(1.0, 1), (1.4, 1), (1.5, 3)])  # 400 ms for one token, then 3 tokens in 100 ms
    s = engine_latency._itl_stats(recs, 0.0, 5.0)
    assert s["itl_token_p50_ms"] == pytest.approx(100.0 / 3)  # three of the four tokens came 33 ms apart


class _FakeEngine:
    """add_request / step / has_unfinished / abort: each request yields one token per step, `tokens` in all."""

    def __init__(self, tokens: int):
        self.tokens, self.left, self.aborted, self.added = tokens, {}, [], 0
        self.scheduler = types.SimpleNamespace(running=[])

    def add_request(self, prompt, params):
        rid, self.added = f"r{self.added}", self.added + 1
        self.left[rid] = self.tokens
        return rid

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        time.sleep(0.002)
        outs = [types.SimpleNamespace(request_id=r, new_token_ids=[7]) for r in self.left]
        self.left = {r: n - 1 for r, n in self.left.items() if n > 1}
        return outs

    def abort(self, rid):
        self.aborted.append(rid)
        self.left.pop(rid, None)


def test_drive_adds_requests_at_their_arrival_and_records_each_delivery():
    engine = _FakeEngine(tokens=3)
    params = SamplingParams(max_tokens=3)
    recs, wall, cut, _ = engine_latency._drive(engine, [(0.0, [1]), (0.05, [2]), (0.1, [3])], params, limit=5.0)
    assert not cut and wall >= 0.1
    assert sorted(at for at, _ in recs.values()) == [0.0, 0.05, 0.1]
    for at, d in recs.values():
        assert [n for _, n in d] == [1, 1, 1] and d[0][0] >= at  # no token before its request arrived
    recs, _, cut, _ = engine_latency._drive(_FakeEngine(tokens=10**6), [(0.0, [1])], params, limit=0.05)
    assert cut  # bounded: a request that never ends is cut at the limit (and aborted)


def test_bad_options_name_the_flag(capsys):
    for argv, flag in (
        (["--what", "profile,bogus"], "--what"),
        (["--what", "ttft", "--no_trace"], "--no_trace"),
        (["--what", "ttft", "--ttft_backends", "triton"], "--ttft_backends"),
        (["--what", "profile", "--preset", "tiny", "--batches", "1,64"], "--batches"),
    ):
        with pytest.raises(SystemExit):
            engine_latency._args(argv)
        assert flag in capsys.readouterr().err


def test_every_mode_runs_on_tiny_and_writes_json(tmp_path):
    out = tmp_path / "engine_latency.jsonl"
    argv = ["--what", "profile,ttft,long,itl_load", "--preset", "tiny", "--dtype", "float32", "--out", str(out)]
    argv += ["--peak", "200"]  # a fixed light load: 0.8x a CPU burst's rate would bury this host in arrivals
    engine_latency.main(
        argv + ["--trace_dir", str(tmp_path / "trace"), "--long_backends", "pallas,xla_contiguous,xla_paged"]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    by = {}
    for r in rows:
        by.setdefault(r["what"], []).append(r)
    assert [r["batch"] for r in by["profile"]] == [1, 4]
    assert all(r["loops"] >= 2 and r["wall_ms_per_step"] > 0 for r in by["profile"])  # CPU: no device events
    assert {r["backend"] for r in by["ttft"]} == {"pallas", "xla"}
    assert all(r["reps"] == 3 and r["ttft_p50_ms"] > 0 and r["runner_prefill_p50_ms"] > 0 for r in by["ttft"])
    paths = {(r["length"], r["path"]) for r in by["long"]}
    assert paths == {(64, "pallas_chunked"), (128, "pallas_chunked"), (128, "pallas_one_piece"),
                     (64, "xla_paged_chunked"), (128, "xla_paged_chunked"),
                     (64, "xla_contiguous"), (128, "xla_contiguous")}  # fmt: skip
    assert all(isinstance(r["ms"], float) for r in by["long"])  # nothing runs out of memory at these sizes
    assert by["long"][1]["engine_steps"] == 2  # 128 tokens in chunks of 64: two steps
    summary = by["long_summary"][0]["rows"]
    assert [t["length"] for t in summary] == [64, 128] and "pallas_vs_xla_time" in summary[1]
    idle, load = by["itl_idle"][0], by["itl_load"][0]
    assert idle["requests"] == 2 and idle["tokens_per_delivery"] > 1  # alone, rows decode in multi-step loops
    # Without a warm-up (CPU) the load's first steps compile, so its window may hold no delivery: shape only here
    # (the statistics are test_itl_stats_count_each_token_of_a_delivery's).
    assert load["arrivals"] > 0 and load["load_stats"]["requests"] > 0 and load["mean_running"] > 0
    assert load["peak_output_tokens_per_s"] == 200 and load["arrival_rate_rps"] == pytest.approx(0.8 * 200 / 24)
    assert load["goal_metric"].startswith("itl_token_p99_load_over_idle")
    assert {r["what"] for r in rows} >= {"profile_done", "ttft_done", "long_done", "itl_load_done", "engine"}


def test_untraced_profile_without_chained_loops(tmp_path):
    """--no_trace times the same loops without the profiler; --async_scheduling off chains none of them."""
    out = tmp_path / "engine_latency.jsonl"
    engine_latency.main(["--what", "profile", "--preset", "tiny", "--dtype", "float32", "--no_trace", "--async_scheduling",
                 "off", "--batches", "4", "--trace_dir", str(tmp_path / "trace"), "--out", str(out)])  # fmt: skip
    (row,) = [r for r in map(json.loads, out.read_text().splitlines()) if r["what"] == "profile"]
    assert not row["traced"] and row["async_scheduling"] == "off" and row["chained_loops"] == 0
    assert row["loops"] >= 2 and row["wall_ms_per_step"] > 0 and "per_step_ms" not in row
    assert not (tmp_path / "trace").exists()  # no profiler ran
