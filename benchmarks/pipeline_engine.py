"""Pipeline-parallel engine on real devices: greedy tokens and throughput, one device vs p stages.

SmolLM2-135M (GGUF, dequantised to --dtype) serves the same greedy requests through LLMEngine on one device and on
each --pp degree (default kernels unless --backend); the script reports tokens/s per mesh and whether every
request's tokens equal the one-device run (expected in float32; bf16 may drift where logits tie closely).

    python benchmarks/pipeline_engine.py --pp 2 --dtype float32 --out $OUT/pipeline_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.gguf import load_gguf
from checkpoints.loader import default_model_path
from checkpoints.tokenizer import NullTokenizer
from model.transformer import build_model
from serving.config import EngineConfig
from serving.engine.engine import LLMEngine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="2", help="pipeline degrees to compare with one device")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--backend", default="", help="attention backend (empty: the device's default)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt_len", type=int, default=200)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cfg, params = load_gguf(default_model_path(download=False))[:2]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.prompts)]
    options = dict(max_num_seqs=args.prompts, max_num_batched_tokens=2048, max_model_len=1024, decode_steps=8)
    if args.backend:
        options["attention_backend"] = args.backend
    runs, base = [], None
    for pp in [1] + [int(p) for p in args.pp.split(",")]:
        model = build_model(cfg, params, jnp.dtype(args.dtype))
        engine = LLMEngine(model, NullTokenizer(), EngineConfig.from_kwargs(**options, pipeline_parallel_size=pp))
        engine.generate([None] * 2, prompts[:2], max_tokens=4, temperature=0.0, ignore_eos=True)  # compile
        t0 = time.perf_counter()
        out = engine.generate(
            [None] * len(prompts), prompts, max_tokens=args.max_tokens, temperature=0, ignore_eos=True
        )
        seconds = time.perf_counter() - t0
        tokens = [list(o.token_ids) for o in out]
        base = tokens if base is None else base
        same = sum(t == b for t, b in zip(tokens, base))
        run = dict(pp=pp, seconds=seconds, tokens_per_s=sum(map(len, tokens)) / seconds, identical=same)
        runs.append(run)
        print(json.dumps(run), flush=True)
        del engine, model
    result = dict(device=f"{jax.devices()[0].device_kind} x{jax.device_count()}", dtype=args.dtype, runs=runs)
    result.update(prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
