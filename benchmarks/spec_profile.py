"""Where a speculative verify pass spends its time: host profile of plain vs n-gram and self decoding, batch 1.

    PYTHONPATH=. python benchmarks/spec_profile.py --preset smollm2_135m --dtype bfloat16 --out prof.json

Random weights at the preset's shape; one copy-heavy token prompt (a 16-token pattern repeated, so the n-gram
proposer finds drafts); each method generates twice (the first compiles), the second is timed and profiled with
cProfile. Per method it prints tokens/s, verify passes, ms per engine step, and the functions with the most own
time and cumulative time (waits on the device show as numpy.asarray / block_until_ready).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import jax
import numpy as np

from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.llm import LLM


def _run(model, method: str, args) -> dict:
    opts = dict(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=min(1024, model.cfg.max_position_embeddings),
        decode_steps=8,
        warmup=False,
    )
    if method != "off":
        opts.update(speculative_method=method, num_speculative_tokens=args.k)
    if method == "self":  # all but the last layer: high acceptance, so the cost per pass shows
        opts.update(speculative_draft_layers=model.cfg.num_layers - 1)
    llm = LLM.from_model(model, **opts)
    rng = np.random.default_rng(0)
    v = model.cfg.vocab_size
    prompt = rng.integers(3, v, 64).tolist() + rng.integers(3, v, 16).tolist() * 6

    def go():
        return llm.generate([prompt], max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    go()
    go()
    steps0 = llm.engine.num_steps if hasattr(llm.engine, "num_steps") else None
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    out = go()
    prof.disable()
    dt = time.perf_counter() - t0
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(15)
    st.sort_stats("cumulative").print_stats(30)
    spec = llm.engine.spec
    res = dict(
        method=method,
        tokens=len(out[0].token_ids),
        seconds=round(dt, 4),
        tokens_per_s=round(len(out[0].token_ids) / dt, 1),
        spec=spec.metrics() if spec else None,
        steps=(llm.engine.num_steps - steps0) if steps0 is not None else None,
        profile=s.getvalue(),
    )
    print(json.dumps({k: v for k, v in res.items() if k != "profile"}))
    print(res["profile"])
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2_135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--methods", default="off,ngram,self")
    p.add_argument("--out", default="")
    args = p.parse_args()
    model = random_model(ModelConfig.preset(args.preset), dtype=jax.numpy.dtype(args.dtype))
    results = [_run(model, m, args) for m in args.methods.split(",")]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
