"""What a new user meets with the defaults on a CPU host: footprint, pool size, and one prompt
decoding alone against three together.

    PYTHONPATH=. python benchmarks/cpu_defaults.py --out bench_out/cpu_defaults.json

`LLM()` with no options (the embedded SmolLM2, float32), then greedy generation of 48 tokens for one prompt, then
for three prompts together (ignore_eos, so every prompt yields exactly 48 tokens). Reports the KV pool's blocks and
tokens, peak RSS (ru_maxrss) after load and at the end, and seconds per run (after a first untimed run of each
shape, so compilation is excluded and reported separately).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(llm, prompts, max_tokens):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max_tokens", type=int, default=48)
    p.add_argument("--out", default="cpu_defaults.json")
    a = p.parse_args()
    from serving import LLM

    t0 = time.perf_counter()
    llm = LLM()
    engine = llm.engine
    load_s = time.perf_counter() - t0
    rss_load = _rss_mb()
    res = dict(
        num_kv_blocks=engine.runner.num_blocks,
        kv_tokens=(engine.runner.num_blocks - 1) * engine.config.block_size,
        load_s=load_s,
        rss_after_load_mb=rss_load,
    )
    for name, prompts in (("one_prompt", PROMPTS[:1]), ("three_prompts", PROMPTS)):
        res[f"{name}_first_s"] = _timed(llm, prompts, a.max_tokens)  # includes compiling the buckets it needs
        res[f"{name}_s"] = _timed(llm, prompts, a.max_tokens)
        res[f"{name}_tokens_per_s"] = len(prompts) * a.max_tokens / res[f"{name}_s"]
    res["rss_peak_mb"] = _rss_mb()
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
