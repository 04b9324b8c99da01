"""Online load test over HTTP: a request-rate sweep against one server, as users read serving figures.

    PYTHONPATH=. python benchmarks/serving_load.py --rates 1,2,4,8 --num_requests 200 \\
        --random_weights llama3_8b --engine_options '{"quantization": "w8a8_fp8_rtn", "kv_cache_dtype": "int8"}'
    PYTHONPATH=. python benchmarks/serving_load.py --rates 0.5,1 --num_requests 8 --input_median 64 \\
        --output_median 16 -- --max_num_seqs 8 --attention_backend xla         (the default model's server binary)
    PYTHONPATH=. python benchmarks/serving_load.py --base_url http://127.0.0.1:8000 --rates 2,4   (a running one)

The server: a running one on loopback (--base_url); else one started here on a free loopback port and stopped at
the end: the server binary (`python -m serving.server` with the flags after `--`), or, with --random_weights
PRESET, this file in its serving role (--serve_port): a model of the preset's shape with random weights
(model/transformer.py random_model, bfloat16) behind the same app (serving/api/app.py), prompts as token ids.

The workload: --num_requests requests with ShareGPT-like lengths generated here (benchmarks/bench_serving.py
sharegpt_like: log-normal input and output lengths, seeded, random token ids; ignore_eos so every request
produces its max_tokens), the same requests at every rate, after --warmup_requests of them sent at once
unmeasured. Per rate, Poisson arrivals at that mean rate, streamed
completions (bench_serving.run: one unmeasured warm-up request first), and one row: output tok/s, request/s,
TTFT, ITL (gaps between stream chunks), TPOT and end-to-end p50 / p99, completed / failed counts and the server's
preemptions. Writes --out (JSON: the rows and the setting) and a PNG beside it (output tok/s, TTFT and ITL against
the rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys

from benchmarks import bench_serving as bs
from benchmarks import local_server

ROW_STATS = ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")


def parse_rates(text: str) -> list[float]:
    """'0.5,1,inf' -> [0.5, 1.0, inf]; every rate > 0 (inf: all requests at once)."""
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates must be a comma-separated list of rates > 0 (inf allowed), got {text!r}")
    return rates


def rate_row(rate: float, summary: dict) -> dict:
    """One sweep row from bench_serving.run's summary at `rate`."""
    row = dict(
        request_rate=rate,
        completed=summary["completed"],
        failed=summary["failed"],
        planned=summary["planned"],
        duration_s=summary["duration_s"],
        request_throughput=summary["request_throughput"],
        output_throughput=summary["output_throughput"],
        total_token_throughput=summary["total_token_throughput"],
        tokens_per_chunk=summary["tokens_per_chunk"],
        preemptions=summary.get("server", {}).get("preemptions"),
    )
    for name in ROW_STATS:
        row[name] = {k: summary[name][k] for k in ("p50", "p99", "mean")}
    return row


def sweep(cfg: bs.ServingBenchConfig, rates: list[float], requests: list[bs.BenchRequest], warmup: int) -> list[dict]:
    """bench_serving.run at each rate over the same requests, against cfg.base_url (a healthy server), after
    `warmup` of them sent at once unmeasured (the shapes the workload needs compiled before the clock starts, where
    the server compiles on demand)."""
    if warmup:
        bs.run(dataclasses.replace(cfg, num_requests=min(warmup, len(requests)), request_rate=math.inf), requests)
    rows = []
    for rate in rates:
        summary = bs.run(dataclasses.replace(cfg, request_rate=rate), requests)
        rows.append(rate_row(rate, summary))
        r = rows[-1]
        print(
            f"serving_load rate {rate:g}/s: {r['completed']}/{r['planned']} done, {r['output_throughput']:.1f} "
            f"output tok/s, TTFT p50 {r['ttft_ms']['p50']:.1f} p99 {r['ttft_ms']['p99']:.1f} ms, ITL p50 "
            f"{r['itl_ms']['p50']:.1f} p99 {r['itl_ms']['p99']:.1f} ms, preemptions {r['preemptions']}",
            flush=True,
        )
    return rows


def plot(result: dict, path: str) -> None:
    """PNG: output tok/s, TTFT p50 / p99 and ITL p50 / p99 against the request rate (inf drawn past the last)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    finite = [r["request_rate"] for r in rows if math.isfinite(r["request_rate"])] or [1.0]
    xs = [r["request_rate"] if math.isfinite(r["request_rate"]) else 2 * max(finite) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(xs, [r["output_throughput"] for r in rows], "o-")
    axes[0].set_ylabel("output tokens / s")
    for ax, name, title in ((axes[1], "ttft_ms", "TTFT"), (axes[2], "itl_ms", "inter-token latency")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [r[name][q] if r[name][q] is not None else math.nan for r in rows], style, label=q)
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.legend()
    for ax in axes:
        ax.set_xlabel("request rate (requests / s; Poisson)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{r['request_rate']:g}" for r in rows])
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['label']}: {result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class IdsTokenizer:
    """The random-weight server's tokenizer: a token's text is its id (" 17"), and text of ids encodes back, so the
    completions API streams text as for a real model (the benchmark sends token ids and reads usage counts)."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ValueError("a random-weight model reads prompts of token ids (or their decimal text)") from None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(i)}" for i in ids)


def serve_random(preset: str, port: int, engine_options: dict) -> None:
    """This file's serving role: a random-weight model of `preset`'s shape behind the server's app on loopback."""
    import jax.numpy as jnp
    import uvicorn

    from model.config import ModelConfig
    from model.transformer import random_model
    from serving.api.app import create_app
    from serving.engine.llm import LLM

    def load():
        model = random_model(ModelConfig.preset(preset), jnp.bfloat16, seed=0)
        return LLM.from_model(model, IdsTokenizer(), copy=False, **engine_options)

    app = create_app(load, model_name=f"{preset}-random", warmup=True)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")).run()


def _start(args, server_args: list[str]) -> tuple[str, subprocess.Popen]:
    port = local_server.free_port()
    if not args.random_weights:
        return f"http://127.0.0.1:{port}", local_server.start_server(port, server_args)
    cmd = [sys.executable, "-m", "benchmarks.serving_load", "--serve_port", str(port)]
    cmd += ["--random_weights", args.random_weights, "--engine_options", args.engine_options]
    env = dict(os.environ, PYTHONPATH=local_server.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("server:", " ".join(cmd), file=sys.stderr)
    return f"http://127.0.0.1:{port}", subprocess.Popen(cmd, cwd=local_server.ROOT, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,2,4,8", help="mean requests / s per run, comma-separated (inf: at once)")
    p.add_argument("--num_requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input_median", type=int, default=128)
    p.add_argument("--input_sigma", type=float, default=1.0)
    p.add_argument("--input_max", type=int, default=1024)
    p.add_argument("--output_median", type=int, default=128)
    p.add_argument("--output_sigma", type=float, default=0.8)
    p.add_argument("--output_max", type=int, default=1024)
    p.add_argument("--max_concurrency", type=int, default=None)
    p.add_argument("--warmup_requests", type=int, default=16, help="sent at once before the sweep, unmeasured")
    p.add_argument("--duration_s", type=float, default=600.0, help="cap per rate; requests then in flight are cut")
    p.add_argument("--base_url", default=None, help="a running server on loopback (default: start one)")
    p.add_argument("--random_weights", default="", help="serve a random-weight model of this preset's shape")
    p.add_argument("--engine_options", default="{}", help="JSON of LLM options for --random_weights")
    p.add_argument("--serve_port", type=int, default=0, help=argparse.SUPPRESS)  # the serving role
    p.add_argument("--startup_timeout_s", type=float, default=1800.0)
    p.add_argument("--out", default="benchmarks/results/serving_load.json")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        engine_options = json.loads(args.engine_options)
        rates = parse_rates(args.rates)
        if args.serve_port:
            serve_random(args.random_weights, args.serve_port, engine_options)
            return 0
        if args.base_url and (args.random_weights or server_args):
            raise ValueError("--base_url targets a running server: no --random_weights or server flags with it")
        base = dict(num_requests=args.num_requests, max_concurrency=args.max_concurrency, seed=args.seed)
        cfg = bs.ServingBenchConfig(base_url=args.base_url, duration_s=args.duration_s, **base)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lengths = (args.input_median, args.input_sigma, args.input_max, args.output_median, args.output_sigma)
    requests = bs.sharegpt_like(args.num_requests, args.seed, *lengths, args.output_max)
    if args.random_weights:  # the prompt ids inside the preset's vocabulary (a small test model's)
        from model.config import ModelConfig

        vocab = ModelConfig.preset(args.random_weights).vocab_size
        requests = [dataclasses.replace(r, prompt=[t % vocab for t in r.prompt]) for r in requests]
    proc = None
    if args.base_url is None:
        url, proc = _start(args, server_args)
        cfg = dataclasses.replace(cfg, base_url=url)
    try:
        startup_s = local_server.wait_healthy(cfg.base_url, proc, args.startup_timeout_s)
        rows = sweep(cfg, rates, requests, args.warmup_requests)
    finally:
        exit_code = local_server.stop_server(proc) if proc is not None else None
    label = f"{args.random_weights} shape, random weights" if args.random_weights else "server binary"
    result = dict(
        label=label if not args.base_url else args.base_url,
        device=bs.host_device(),
        server_args=server_args,
        engine_options=engine_options,
        workload=dict(vars(args), rates=rates),
        server_startup_s=startup_s,
        server_exit_code=exit_code,
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
