"""Step cost of a speculative verify pass (k+1 query tokens per row) against a plain decode step (1 per row).

    PYTHONPATH=. python benchmarks/spec_verify_cost.py --preset llama3_8b --dtype bfloat16 \
        --batches 1,4,16,64 --ks 1,2,4,7 --context 512 --out benchmarks/results/spec_verify_cost_h200.json
    PYTHONPATH=. python benchmarks/spec_verify_cost.py --preset tiny --dtype float32 --batches 1,2 --ks 1,4   # CPU

Random weights at the preset's shape, the runner's compiled steps as serving runs them (ModelRunner.forward: the
paged decode kernel for one token per row, the ragged kernel with logits at every token for verify rows), every
row at `--context` tokens of KV. Reported per batch B and k: median seconds of the one-token step and of the verify
step, their ratio, and the batch-1 speedup speculation would give at acceptance a,
    speedup(a, k) = E(a, k) / ratio(k),  E(a, k) = (1 - a^(k+1)) / (1 - a),
for each --acceptances (e.g. the rates measured on SmolLM2 by benchmarks/spec_engine.py). The goal for the
8B verify pass: k+1 = 5 tokens at <= 1.15x a single-token step. The proposer's own cost is not included.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.runner import ModelRunner, RowInput
from serving.spec.rule import expected_tokens_per_pass


def _rows(batch: int, n_tokens: int, context: int, block_size: int) -> list[RowInput]:
    """`batch` rows, each with its own pages, computing n_tokens at positions context .. context + n - 1."""
    per_row = -(-(context + n_tokens) // block_size)
    rows = []
    for b in range(batch):
        table = list(range(1 + b * per_row, 1 + (b + 1) * per_row))
        rows.append(RowInput([7] * n_tokens, context, table, num_logits=n_tokens))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3_8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ks", default="1,2,4,7")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--acceptances", default="0.5,0.7,0.8,0.9")
    ap.add_argument("--attention_backend", default=None)
    ap.add_argument("--out", default="benchmarks/results/spec_verify_cost.json")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    accs = [float(x) for x in args.acceptances.split(",")]
    cfg = getattr(ModelConfig, args.preset)()
    model = random_model(cfg, jnp.dtype(args.dtype))
    bs, k_max, b_max = 16, max(ks), max(batches)
    per_row = -(-(args.context + k_max + 1) // bs)
    runner = ModelRunner(
        model,
        num_blocks=1 + b_max * per_row,
        block_size=bs,
        max_num_seqs=b_max,
        max_num_batched_tokens=max(256, b_max * (k_max + 1)),
        max_model_len=args.context + k_max + 1 + bs,
        attention_backend=args.attention_backend,
        max_logits_per_row=k_max + 1,
    )
    results = []
    for b in batches:
        one = median_seconds(lambda r=_rows(b, 1, args.context, bs): runner.forward(r), iters=5, reps=3)
        for k in ks:
            t = median_seconds(lambda r=_rows(b, k + 1, args.context, bs): runner.forward(r), iters=5, reps=3)
            ratio = t / one
            row = dict(batch=b, k=k, one_token_s=one, verify_s=t, ratio=round(ratio, 4))
            row["speedup_at"] = {str(a): round(expected_tokens_per_pass(a, k) / ratio, 3) for a in accs}
            results.append(row)
            print(json.dumps(row), flush=True)
    out = dict(
        command="PYTHONPATH=. python benchmarks/spec_verify_cost.py "
        + " ".join(f"--{k}={v}" for k, v in vars(args).items()),
        device=str(jax.devices()[0]),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        backend=runner.backend or "default",
        results=results,
    )
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
