"""How a streaming client sees the tokens arrive: chunks, tokens per chunk and the gaps between chunks, measured
with the `openai` package against `python -m serving.server`, once per server configuration.

    PYTHONPATH=. python benchmarks/stream_gaps.py --configs "decode_steps=8;decode_steps=1" --max_tokens 64

For each configuration (`;`-separated, each a `,`-separated list of server flags without the dashes) a server is
started on a loopback port with the default model (or --model), warmed with one request, then `--streams`
concurrent chat streams of `--max_tokens` tokens each (ignore_eos) are read with `openai.OpenAI(...).chat.
completions.create(stream=True)`. Per configuration: token chunks seen, tokens per chunk, the gap between chunks
p50 / p99 / max (ms), time to first token and output tokens/s, pooled over the streams. Prints one JSON line per
configuration and appends them to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

import numpy as np

from benchmarks import local_server


def read_stream(client, model: str, max_tokens: int, prompt: str) -> dict:
    t0 = time.perf_counter()
    times, texts = [], []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            texts.append(chunk.choices[0].delta.content)
    return dict(start=t0, times=times, tokens=tokens, end=time.perf_counter())


def summarise(config: str, streams: list[dict]) -> dict:
    gaps = [1e3 * (b - a) for s in streams for a, b in zip(s["times"], s["times"][1:])]
    chunks = sum(len(s["times"]) for s in streams)
    tokens = sum(s["tokens"] for s in streams)
    wall = max(s["end"] for s in streams) - min(s["start"] for s in streams)
    pct = lambda q: round(float(np.percentile(gaps, q)), 1) if gaps else None  # noqa: E731
    return dict(
        bench="stream_gaps",
        config=config,
        streams=len(streams),
        tokens=tokens,
        chunks=chunks,
        tokens_per_chunk=round(tokens / max(chunks, 1), 2),
        gap_p50_ms=pct(50),
        gap_p99_ms=pct(99),
        gap_max_ms=round(max(gaps), 1) if gaps else None,
        ttft_ms=round(1e3 * statistics.median(s["times"][0] - s["start"] for s in streams if s["times"]), 1),
        output_tok_s=round(tokens / wall, 1),
    )


def run_config(a, config: str) -> dict:
    import openai

    flags = [f"--{f.strip()}" for f in config.split(",") if f.strip()]
    if a.model:
        flags.append(f"--model={a.model}")
    port = local_server.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = local_server.start_server(port, flags + a.server_flags.split())
    try:
        local_server.wait_healthy(url, proc, a.start_timeout)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=a.request_timeout)
        model = client.models.list().data[0].id
        read_stream(client, model, a.max_tokens, a.prompt)  # warm: every shape the measured streams meet
        with concurrent.futures.ThreadPoolExecutor(a.streams) as pool:
            futures = [pool.submit(read_stream, client, model, a.max_tokens, a.prompt) for _ in range(a.streams)]
            streams = [f.result() for f in futures]
        return summarise(config, streams)
    finally:
        local_server.stop_server(proc)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="decode_steps=8;decode_steps=1", help="';'-separated server flag lists")
    p.add_argument("--server_flags", default="--max_model_len=512", help="flags every configuration gets")
    p.add_argument("--model", default="", help="default: the default model")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    p.add_argument("--start_timeout", type=float, default=600.0)
    p.add_argument("--request_timeout", type=float, default=600.0)
    p.add_argument("--out", default="stream_gaps.jsonl")
    a = p.parse_args(argv)
    with open(a.out, "a") as f:
        for config in a.configs.split(";"):
            row = run_config(a, config)
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
