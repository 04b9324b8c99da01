"""The README's plot: batch-1 decode tokens/s per weight format, GEMV on against the XLA paths, from a JSON that
benchmarks/decode_llama.py wrote with `--gemv on,off` (`bash benchmarks/gpu.sh decode gemv`).

    PYTHONPATH=. python benchmarks/plot_decode_formats.py \
        --json benchmarks/results/decode_gemv_h100_2026-12-06.json --out docs/decode_formats_h100.png
"""

from __future__ import annotations

import argparse
import json

FORMAT_LABELS = {"bf16": "bf16", "int8": "int8 W8A16", "fp8": "fp8 W8A16", "int4_rtn": "int4 g128"}


def batch1_rates(runs: list[dict]) -> dict[str, dict[str, float]]:
    """{format: {"on": tok/s, "off": tok/s}} of the batch-1 rows of decode_llama.py's runs."""
    rates: dict[str, dict[str, float]] = {}
    for run in runs:
        for row in run["rows"]:
            if row["batch"] == 1:
                rates.setdefault(run["format"], {})[run["gemv"]] = row["tokens_per_s_loop"]
    return rates


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.json) as f:
        runs = json.load(f)["runs"]
    rates = batch1_rates(runs)
    formats = [f for f in FORMAT_LABELS if f in rates]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=120)
    xs = range(len(formats))
    for offset, gemv, label, colour in (
        (-0.2, "off", "XLA dot / dequantise + dot", "#999999"),
        (0.2, "on", "ours (GEMV)", "#1f77b4"),
    ):
        values = [rates[f].get(gemv, 0.0) for f in formats]
        bars = ax.bar([x + offset for x in xs], values, width=0.4, label=label, color=colour)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(list(xs), [FORMAT_LABELS[f] for f in formats])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Llama-3-8B shape, batch-1 decode, one {runs[0]['device']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
