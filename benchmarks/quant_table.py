"""The per-format table as one figure: Llama-3-8B decode tokens/s beside SmolLM2 perplexity (CPU).

    PYTHONPATH=. python benchmarks/quant_table.py --out benchmarks/results/quant_formats_h200.png

Reads the saved results, measures nothing: decode rows from benchmarks/decode_llama.py runs (--formats, with and
without --stream_layout, and the H100 GEMV run, whose rows with --gemv off are left out), quality rows from
benchmarks/quant_quality.py --path api (prose and code perplexity change vs float, measured through
`LLM(quantization=...)` with its default calibration, on held-out text). Each series names its device: the GEMV
series ran on an H100 (no H200 was available that day), the others on the H200. Formats without a row in a file are
left out of that panel.
"""

from __future__ import annotations

import argparse
import json

R = "benchmarks/results/"
DECODE = {"H200, XLA / Triton kernel": R + "decode_formats_llama3_8b_h200.json", "H200, Mosaic streaming kernel":
          R + "decode_formats_stream_llama3_8b_h200.json",
          "H100, GEMV": R + "decode_gemv_h100_2026-12-06.json"}  # fmt: skip
QUALITY = R + "quant_quality_api.json"  # quant_quality.py --path api: LLM(quantization=...) with its defaults
QUALITY_METHODS = ("int8", "fp8", "w8a8_fp8", "w8a8_fp8_rtn", "int4_rtn", "int4_awq", "int4_gptq", "kv_int8", "kv_fp8")


def decode_rows(path: str) -> dict:
    """{(format, batch): tokens/s} of one decode_llama.py JSON (one run or {"runs": [...]})."""
    with open(path) as f:
        data = json.load(f)
    runs = [r for r in data.get("runs", [data]) if r.get("gemv", "on") == "on"]
    return {(r["format"], row["batch"]): row["tokens_per_s_loop"] for r in runs for row in r["rows"]}


def quality_rows(path: str) -> dict:
    """{(method, domain): perplexity change in %} of a quant_quality.py JSON."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["method"], r["domain"]): r["ppl_delta_pct"] for r in rows if "ppl_delta_pct" in r}


def plot(out: str, quality_path: str = QUALITY) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = {label: decode_rows(path) for label, path in DECODE.items()}
    quality = quality_rows(quality_path)
    formats = ["bf16", "int8", "fp8", "int4_rtn"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, batch in zip(axes[:2], (1, 64)):
        width = 0.8 / len(decode)
        for i, (label, rows) in enumerate(decode.items()):
            xs = [j + i * width for j, f in enumerate(formats) if (f, batch) in rows]
            ys = [rows[(f, batch)] for f in formats if (f, batch) in rows]
            if not ys:  # a series without this batch (the GEMV runs are batch 1 only)
                continue
            bars = ax.bar(xs, ys, width, label=label, color=f"C{i}")
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(formats))], formats)
        ax.set_title(f"Llama-3-8B shape decode, batch {batch}")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(top=1.3 * max(v for rows in decode.values() for (f, b), v in rows.items() if b == batch))
        ax.legend(fontsize=8, loc="upper left")
    methods = [m for m in QUALITY_METHODS if (m, "prose") in quality]
    for i, domain in enumerate(("prose", "code")):
        ys = [quality[(m, domain)] for m in methods]
        bars = axes[2].bar([j + i * 0.4 for j in range(len(methods))], ys, 0.4, label=domain)
        axes[2].bar_label(bars, fmt="%+.1f", fontsize=8)
    axes[2].set_xticks([j + 0.2 for j in range(len(methods))], methods, fontsize=8)
    axes[2].set_yscale("symlog", linthresh=1.0)
    axes[2].set_title("SmolLM2-135M perplexity change vs float, LLM(quantization=...) (CPU)")
    axes[2].set_ylabel("% perplexity")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=R + "quant_formats_h200.png")
    p.add_argument("--quality", default=QUALITY, help="a quant_quality.py JSON")
    args = p.parse_args()
    plot(args.out, args.quality)


if __name__ == "__main__":
    main()
