"""Peak host memory and time of model creation, each case in a fresh process.

    PYTHONPATH=. python benchmarks/load_model.py --case gguf --dtypes float32,bfloat16 --label after
    PYTHONPATH=. python benchmarks/load_model.py --case random --preset llama3_8b --dtypes bfloat16 --impl both

Cases:
  gguf     `LLM(dtype=...)` on the default SmolLM2 GGUF (or --model): checkpoint read, dequantisation and
           model build, timed until every parameter is ready (`LLM.load_seconds` is reported too).
  random   `random_model(cfg, dtype)` at a preset's shape. With --impl both, the old creation path
           (`Transformer(cfg, rngs=nnx.Rngs(seed))`: the whole module initialised at once) runs as a second case.

Every case runs in its own child process, so `ru_maxrss` (peak resident set of the process) is that case's peak;
the peak after imports and backend start-up is reported as `import_rss_mb`, so the load's own share can be read
off. Prints one
line per case and writes the JSON list to --out (default benchmarks/results/load_model_<case>_<label>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB.


def _child(args: argparse.Namespace) -> dict:
    """Runs one case in this (fresh) process and returns its figures."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model.config import ModelConfig
    from model.transformer import Transformer, random_model

    if args.case == "gguf":
        from serving import LLM

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    jax.block_until_ready(jnp.zeros(()))  # Starts the backend (CUDA context) before the baseline is read.
    import_rss = _peak_rss_mb()
    t0 = time.perf_counter()
    extra = {}
    if args.case == "gguf":
        llm = LLM(args.model, dtype=args.dtype)
        model = llm.model
        extra["llm_load_seconds"] = llm.load_seconds
    elif args.impl == "old":
        model = Transformer(ModelConfig.preset(args.preset), dtype=dtype, rngs=nnx.Rngs(params=0))
    else:
        model = random_model(ModelConfig.preset(args.preset), dtype, seed=0)
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    return {
        "case": args.case,
        "impl": args.impl if args.case == "random" else "-",
        "label": args.label,
        "model": args.model or "default" if args.case == "gguf" else args.preset,
        "dtype": args.dtype,
        "seconds": round(seconds, 3),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "import_rss_mb": round(import_rss, 1),
        "param_bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        **extra,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("gguf", "random"), default="gguf")
    p.add_argument("--model", default=None, help="checkpoint for --case gguf (default: the embedded SmolLM2)")
    p.add_argument("--preset", default="llama3_8b", help="ModelConfig preset for --case random")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--impl", choices=("new", "old", "both"), default="new", help="random: creation path(s)")
    p.add_argument("--label", default="after", help="free text stored with each row (e.g. before / after)")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per case")
    p.add_argument("--out", default=None)
    p.add_argument("--dtype", help=argparse.SUPPRESS)  # Set in the child process.
    args = p.parse_args()
    if args.dtype is not None:
        print(json.dumps(_child(args)))
        return
    impls = ("new", "old") if args.impl == "both" else (args.impl,)
    rows = []
    for dtype in args.dtypes.split(","):
        for impl in impls if args.case == "random" else ("new",):
            for _ in range(args.repeats):
                cmd = [sys.executable, __file__, "--case", args.case, "--preset", args.preset, "--impl", impl]
                cmd += ["--label", args.label, "--dtype", dtype] + (["--model", args.model] if args.model else [])
                proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if proc.returncode != 0:
                    raise SystemExit(f"case {dtype}/{impl} failed:\n{proc.stderr[-3000:]}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"{row['case']:6s} {row['impl']:3s} {row['dtype']:8s} {row['seconds']:8.2f} s  "
                    f"peak RSS {row['peak_rss_mb']:8.1f} MB (imports {row['import_rss_mb']:.1f} MB)  "
                    f"params {row['param_bytes'] / 1e6:.1f} MB  on {row['device']}",
                    flush=True,
                )
    out = args.out or os.path.join("benchmarks", "results", f"load_model_{args.case}_{args.label}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
