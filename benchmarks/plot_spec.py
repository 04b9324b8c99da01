"""Speculative decoding's figures as one PNG: the trade under load (p50 latency and throughput per request rate for off,
always-on and adaptive, from benchmarks/spec_load.py JSONs) and batch-1 speedups per proposer and domain (from
benchmarks/spec_engine.py JSONs).

    PYTHONPATH=. python benchmarks/plot_spec.py \
        --load benchmarks/results/spec_load_h200_smollm2_low.json,benchmarks/results/spec_load_h200_smollm2_saturation.json \
        --batch1 benchmarks/results/spec_engine_h200_smollm2_draft_device.json \
        --out benchmarks/results/spec_h200_smollm2.png
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _rows(paths: str) -> list[dict]:
    return [r for p in paths.split(",") for r in json.load(open(p))["rows"]]


def plot(load_rows: list[dict], batch1: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for method in ("off", "always", "adaptive"):
        rows = sorted((r for r in load_rows if r["method"] == method), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["p50_latency_s"] for r in rows], "o-", label=method)
        axes[1].plot(rates, [r["throughput_tok_s"] for r in rows], "o-", label=method)
    axes[0].set(xscale="log", xlabel="request rate (req/s)", ylabel="p50 latency (s)", title="latency under load")
    axes[1].set(xscale="log", yscale="log", xlabel="request rate (req/s)", ylabel="output tokens/s", title="throughput")
    methods = [m for m in batch1["methods"] if m != "off"]
    domains = list(batch1["methods"]["off"])
    x = np.arange(len(domains))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        speedups = [batch1["methods"][m][d].get("speedup") or 0.0 for d in domains]
        axes[2].bar(x + (i - (len(methods) - 1) / 2) * width, speedups, width, label=m)
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[2].set_xticks(x, domains)
    axes[2].set(ylabel="decode tokens/s vs off", title="batch 1, real acceptance")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--load", required=True, help="comma-separated spec_load.py JSONs")
    p.add_argument("--batch1", required=True, help="a spec_engine.py JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="Speculative decoding, SmolLM2-135M bf16, H200")
    args = p.parse_args(argv)
    plot(_rows(args.load), json.load(open(args.batch1)), args.out, args.title)
    print(args.out)


if __name__ == "__main__":
    main()
