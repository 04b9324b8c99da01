"""Expert parallelism by all-to-all (model/moe.py) on the devices at hand: one MoE layer split over `--ep` devices
against the same layer on one device, with the default grouped-matmul backend (the Mosaic GPU kernel on Hopper,
inside the expert shard_map) and with the ragged_dot reference.

    python benchmarks/moe_ep.py --ep 2 --tokens 16,256,2048 --out moe_ep.json

Prints, per token count: the max |difference| and norm-relative error of the EP layer to the one-device layer
(bf16), the router counts (must be equal), and the median time of one jitted layer call on 1 device and on ep
devices (timed after a warm-up, `block_until_ready` on the output). A Mixtral-like layer slice by default
(D 4096, F 14336, 8 experts, top 2); the CPU cannot run the Pallas kernel across devices (its interpreter keeps one
shared memory), so this is the GPU check of that path.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import moe
from model.config import ModelConfig
from sharding.mesh import ParallelConfig, make_mesh


def _time(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--tokens", default="16,256,2048")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.tiny_moe(
        hidden_size=args.hidden,
        moe_intermediate_size=args.ffn,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        shared_expert_intermediate_size=0,
        norm_topk_prob=True,
    )
    mesh = make_mesh(ParallelConfig(ep=args.ep), devices=jax.devices()[: args.ep])
    rows = []
    for backend in (None, "xla"):
        block = moe.MoEMLP(cfg, jnp.bfloat16, nnx.Rngs(params=0), backend=backend)
        one = nnx.jit(lambda b, x: b(x))
        split = nnx.jit(lambda b, x: b(x, mesh=mesh))
        for t in (int(n) for n in args.tokens.split(",")):
            x = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.bfloat16)
            (y1, c1), (y2, c2) = one(block, x), split(block, x)
            a, b = np.asarray(y2, np.float32), np.asarray(y1, np.float32)
            row = dict(
                backend=backend or "default",
                tokens=t,
                max_abs_diff=float(np.abs(a - b).max()),
                rel_err=float(np.linalg.norm(a - b) / np.linalg.norm(b)),
                counts_equal=bool((np.asarray(c1) == np.asarray(c2)).all()),
                one_device_ms=1e3 * _time(one, block, x),
                ep_ms=1e3 * _time(split, block, x),
            )
            rows.append(row)
            print(json.dumps(row))
    record = dict(
        device=f"{jax.devices()[0].device_kind} x{jax.device_count()}", ep=args.ep, config=vars(args), rows=rows
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    bad = [r for r in rows if not r["counts_equal"] or r["rel_err"] > 2e-2]
    print("FAILED" if bad else "ok", len(rows), "rows")


if __name__ == "__main__":
    main()
