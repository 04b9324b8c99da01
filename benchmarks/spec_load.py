"""Speculation's trade under load: off vs always-on vs adaptive at rising request rates.

    PYTHONPATH=. python benchmarks/spec_load.py --rates 0.5,2,8 --out benchmarks/results/spec_load_cpu.json
    PYTHONPATH=. python benchmarks/spec_load.py --preset llama3_8b --replay_acceptance 0.7 --rates 1,8,32,128 \\
        --num_requests 128 --max_num_seqs 64 --memory_budget_gb 60 --spec_batch_threshold 16 --out $OUT/spec_load.json

The workload, engine construction and serving loop are benchmarks/worked_example.py's (code completions of
--max_tokens greedy tokens, Poisson arrivals, a KV pool of what --memory_budget_gb leaves after the weights), with
bf16 weights and KV. Per rate, three engines: `off`; `always` (n-gram speculation, or on random weights the replay
proposer at --replay_acceptance, on every decode step); `adaptive` (the same, only while fewer than
--spec_batch_threshold sequences run; serving/spec/policy.py ramps k down towards the threshold). Reported:
p50 / p95 latency, TTFT p50, throughput, peak running, acceptance. The goal: adaptive keeps >= 90% of
always-on's p50 latency gain at the lowest rate and loses < 3% throughput to `off` at the highest (saturation).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import jax

from benchmarks import worked_example as we
from benchmarks.spec_engine import COMPILES, count_compiles

METHODS = ("off", "always", "adaptive")


def _step(method: str, threshold: int) -> we.Step:
    backend = None  # the default kernels
    if method == "off":
        return we.Step("off", backend)
    return we.Step(method, backend, speculate=True, threshold=threshold if method == "adaptive" else 0)


def run(args) -> dict:
    model, tokenizer, label = we.load(args)
    real = args.preset == "smollm2"  # real text and n-gram drafts; random weights: token ids and replay drafts
    prompts = we.workload_prompts(args, model, tokenizer)
    result = dict(
        model=label,
        device=f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        args=vars(args),
        rows=[],
    )
    recorded = None
    for rate in args.rates:
        times = we.arrivals(args.num_requests, rate, args.seed)
        for method in METHODS:
            step = _step(method, args.spec_batch_threshold)
            proposer = None
            if step.speculate and not real:
                from serving.spec.proposers import ReplayProposer

                seqs = [p + o for p, o in zip(prompts, recorded)]
                proposer = ReplayProposer(
                    seqs, [len(p) for p in prompts], args.replay_acceptance, model.cfg.vocab_size, 0
                )
            engine, capacity, _ = we.make_engine(model, tokenizer, step, args, prompts, proposer)
            warm_up(engine, args, prompts, times)
            trials = we.Trials(engine.spec.proposer) if engine.spec is not None else None
            compiles = COMPILES.count
            served = we.serve(engine, prompts, times, args.max_tokens)
            if method == "off" and recorded is None:
                recorded = served["tokens"]  # greedy continuations: what the replay proposer corrupts
            row = dict(rate=rate, method=method, capacity=capacity) | we.summarize(served, times, args.max_tokens)
            row["compiles"] = COMPILES.count - compiles  # during the timed pass: a compile there skews its latency
            if trials is not None:
                row |= dict(acceptance=trials.successes / max(trials.trials, 1), verify_passes=trials.passes)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            del engine
    result["goals"] = goals(result["rows"])
    print(json.dumps(result["goals"]), flush=True)
    return result


def warm_up(engine, args, prompts, times) -> None:
    """What --warmup asks for after the engine's own warm-up (make_engine runs that for engine and serve)."""
    if args.warmup in ("pass", "serve"):
        we.warm(engine, prompts, args.max_tokens)
    we.warm_rows(engine)
    if args.warmup == "serve":  # the same schedule once untimed: the timed one meets no new shape
        we.serve(engine, prompts, times, args.max_tokens)


def goals(rows: list[dict]) -> dict:
    """Adaptive's share of always-on's p50 latency gain at the lowest rate; throughput vs off at the highest."""
    by = {(r["rate"], r["method"]): r for r in rows}
    lo, hi = min(r["rate"] for r in rows), max(r["rate"] for r in rows)
    gain = by[(lo, "off")]["p50_latency_s"] - by[(lo, "always")]["p50_latency_s"]
    kept = (by[(lo, "off")]["p50_latency_s"] - by[(lo, "adaptive")]["p50_latency_s"]) / gain if gain > 0 else None
    off_tp = by[(hi, "off")]["throughput_tok_s"]
    return dict(
        low_rate=lo,
        always_latency_gain_s=gain,
        adaptive_share_of_gain=kept,
        high_rate=hi,
        always_throughput_vs_off=by[(hi, "always")]["throughput_tok_s"] / off_tp,
        adaptive_throughput_vs_off=by[(hi, "adaptive")]["throughput_tok_s"] / off_tp,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    we.add_workload_flags(p)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 2.0, 8.0])
    p.add_argument("--replay_acceptance", type=float, default=0.7, help="random weights: ReplayProposer's rate")
    p.add_argument(
        "--warmup",
        choices=("engine", "pass", "serve"),
        default="pass",
        help="pass: the workload once untimed, all at once; serve: the engine's warm-up, that pass, then the timed "
        "schedule once untimed (on the H200 the first two alone left compiles inside timed passes)",
    )
    p.add_argument("--out", default="benchmarks/results/spec_load_cpu.json")
    args = p.parse_args(argv)
    count_compiles()  # per timed pass
    result = run(args)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
