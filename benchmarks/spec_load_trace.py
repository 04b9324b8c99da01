"""Per-step trace of one spec_load rate: which path each engine step took (plain decode loop, the on-device
speculative loop, a host verify pass), the running batch, the queue, the step's wall time and tokens emitted.

    PYTHONPATH=. python benchmarks/spec_load_trace.py --rate 128 --num_requests 48 --max_num_seqs 32 \\
        --memory_budget_gb 4 --spec_batch_threshold 8 --out $OUT/spec_load_trace.json

Rows: (path, running, waiting, start s, step s, tokens, compiles in the step). Each method's engine is warmed as spec_load's --warmup serve warms it (the engine's warm-up, a pass,
the schedule once untimed), then serves the schedule once traced.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import spec_load
from benchmarks import worked_example as we
from benchmarks.spec_engine import COMPILES, count_compiles


def traced_serve(engine, prompts, times, max_tokens: int) -> tuple[dict, list]:
    path = {}
    if engine.spec is not None:
        run, verify = engine.spec_loops.run, engine.spec.step

        def loop_run(out):
            done = run(out)
            path["p"] = "spec_loop" if done is not None else path["p"]
            return done

        def verify_step(out):
            path["p"] = "host_verify"
            return verify(out)

        engine.spec_loops.run, engine.spec.step = loop_run, verify_step
    step, log, t0 = engine.step, [], time.perf_counter()

    def traced_step():
        path["p"] = "chained" if engine.loop_in_flight else "plain"
        b, w, c, t = len(engine.scheduler.running), engine.scheduler.num_waiting, COMPILES.count, time.perf_counter()
        outs = step()
        log.append(
            (
                path["p"],
                b,
                w,
                round(t - t0, 4),
                round(time.perf_counter() - t, 4),
                sum(len(o.new_token_ids) for o in outs),
                COMPILES.count - c,  # XLA compilations inside this step
            )
        )
        return outs

    engine.step = traced_step
    served = we.serve(engine, prompts, times, max_tokens)
    engine.step = step
    return served, log


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    we.add_workload_flags(p)
    p.add_argument("--rate", type=float, default=128.0)
    p.add_argument("--methods", default="off,adaptive")
    p.add_argument("--out", default="/tmp/spec_load_trace.json")
    args = p.parse_args(argv)
    args.warmup = "serve"  # spec_load's: the engine's warm-up, a pass, the schedule once untimed
    count_compiles()  # per step
    model, tokenizer, label = we.load(args)
    prompts = we.workload_prompts(args, model, tokenizer)
    times = we.arrivals(args.num_requests, args.rate, args.seed)
    result = dict(model=label, args=vars(args), methods={})
    for method in args.methods.split(","):
        engine, _, _ = we.make_engine(
            model, tokenizer, spec_load._step(method, args.spec_batch_threshold), args, prompts
        )
        spec_load.warm_up(engine, args, prompts, times)
        served, log = traced_serve(engine, prompts, times, args.max_tokens)
        summary = we.summarize(served, times, args.max_tokens)
        by_path = {}
        for pth, _, _, _, dt, n, _ in log:
            a = by_path.setdefault(pth, [0, 0.0, 0])
            a[0], a[1], a[2] = a[0] + 1, a[1] + dt, a[2] + n
        result["methods"][method] = dict(summary=summary, by_path=by_path, steps=log)
        print(method, json.dumps(summary), json.dumps(by_path), flush=True)
        for row in log:
            if row[0] not in ("plain", "chained") or row[4] > 0.02 or row[6]:
                print("  ", row)
        del engine
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
