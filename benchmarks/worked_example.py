"""A worked example, measured: each serving step added on top of the previous, on one workload.

    PYTHONPATH=. python benchmarks/worked_example.py --out benchmarks/results/worked_example_cpu.json
    PYTHONPATH=. python benchmarks/worked_example.py --preset llama3_8b --replay_acceptance 0.55 \\
        --out $OUT/worked_example_h200.json                                       (`bash benchmarks/gpu.sh worked`)

Workload: --num_requests code completions of --max_tokens tokens each (greedy, EOS ignored), prompts cut from
Python standard-library sources (random token ids for a random-weight preset), arriving as a Poisson process of
--rate requests/s; the same prompts and arrival times for every step. Steps, cumulative:

    1 baseline        XLA attention (the reference over the paged cache), --dtype weights and KV
    2 kernels         our Pallas FlashAttention / paged kernels (the default backend; on CPU that is XLA again)
    3 w8a8 int8       SmoothQuant int8 weights and activations (serving/engine/quantize.py, built-in calibration)
    4 int8 KV         int8 pages with per-token scales
    5 spec always     speculative decoding on every decode step (n-gram prompt lookup; `replay` on random weights)
    6 adaptive        speculation only while fewer than --spec_batch_threshold sequences run

Concurrency is KV-cache bound: a fixed --memory_budget_gb holds the weights and the KV pool; what
the weights leave becomes pages, and max_num_seqs is how many full sequences (longest prompt + max_tokens) those
pages hold (at most --max_num_seqs). Quantising weights and KV therefore raises it.

Per step: p50 / p95 latency (arrival to last token), prefill time (TTFT p50: arrival to first token, queueing
included), throughput (requests/s and tokens/s from first arrival to last finish),
the KV-bound concurrency and the peak of running requests, speculation's per-token acceptance (accepted drafts /
Bernoulli trials: a pass with d drafts and m accepted tests m + [m < d] tokens), and quality: perplexity of
held-out stdlib code (benchmarks/quant_quality.py's eval split) under the step's weights and KV numerics; steps 5
and 6 are exact (rejection sampling), so their quality is step 4's. Random weights: quality n/a, and the
speculative steps use ReplayProposer (serving/spec/proposers.py): the target's own greedy continuation (recorded
in step 4, the same weights and KV) corrupted at --replay_acceptance, the acceptance measured on SmolLM2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import quant_quality
from model.config import ModelConfig
from serving.config import EngineConfig
from serving.core.request import SamplingParams

STEPS = ("baseline", "kernels", "w8a8_int8", "kv_int8", "spec_always", "adaptive")
PROMPT_FILES = ("json/decoder.py", "csv.py", "shlex.py", "calendar.py", "difflib.py", "pprint.py")


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    backend: str | None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculate: bool = False
    threshold: int = 0


def steps(args) -> list[Step]:
    kernels = None if args.kernel_backend == "auto" else args.kernel_backend
    return [
        Step("baseline", "xla"),
        Step("kernels", kernels),
        Step("w8a8_int8", kernels, "w8a8_int8"),
        Step("kv_int8", kernels, "w8a8_int8", "int8"),
        Step("spec_always", kernels, "w8a8_int8", "int8", True, 0),
        Step("adaptive", kernels, "w8a8_int8", "int8", True, args.spec_batch_threshold),
    ][: args.num_steps]


# Workload ----------------------------------------------------------------------------------------------------------


def code_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of lo..hi tokens, windows of stdlib sources (not the quality eval files)."""
    ids: list[int] = []
    for name in PROMPT_FILES:
        with open(os.path.join(quant_quality.PY_LIB, name), encoding="utf-8", errors="replace") as f:
            ids += tokenizer.encode(f.read())
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(ids) - length))
        out.append(ids[start : start + length])
    return out


def workload_prompts(args, model, tokenizer) -> list[list[int]]:
    """--num_requests prompts of --prompt_tokens lengths: stdlib code for SmolLM2, random ids for random weights."""
    lo, hi = args.prompt_tokens
    if args.preset == "smollm2":
        return code_prompts(tokenizer, args.num_requests, lo, hi, args.seed)
    rng = np.random.default_rng(args.seed)
    return [
        rng.integers(3, model.cfg.vocab_size, int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.num_requests)
    ]


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The model, workload and engine flags this script shares with benchmarks/spec_load.py."""
    p.add_argument("--preset", default="smollm2", help="smollm2 (the default checkpoint) or a ModelConfig preset")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num_requests", type=int, default=16)
    p.add_argument("--max_tokens", type=int, default=120)
    p.add_argument("--prompt_tokens", type=int, nargs=2, default=(48, 120), metavar=("MIN", "MAX"))
    p.add_argument("--memory_budget_gb", type=float, default=0.3, help="weights + KV pool")
    p.add_argument("--max_num_seqs", type=int, default=8)
    p.add_argument("--max_num_batched_tokens", type=int, default=256)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--num_speculative_tokens", type=int, default=4)
    p.add_argument("--spec_batch_threshold", type=int, default=4)
    p.add_argument("--compilation_cache_dir", default=None, help="persistent XLA cache (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)


def arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Poisson arrival times (s) of n requests at `rate` per second, the first at 0."""
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])])


# One step ----------------------------------------------------------------------------------------------------------


def weight_bytes(model) -> int:
    from flax import nnx

    return sum(int(x.size * x.dtype.itemsize) for x in jax.tree.leaves(nnx.state(model)))


_PREPARED: dict = {}


def prepared(model, tokenizer, quantization: str | None):
    """A copy of `model` with `quantization` applied (quantised once per method, then copied: the engine may
    donate its parameters)."""
    from serving.engine.quantize import quantize_model
    from serving.engine.weights import own_model

    if quantization not in _PREPARED:
        q = own_model(model)
        if quantization:
            quantize_model(q, quantization, tokenizer)
        _PREPARED[quantization] = q
    return own_model(_PREPARED[quantization])


def make_engine(model, tokenizer, step: Step, args, prompts, proposer=None):
    """(engine, capacity, weight bytes): the step's engine on a copy of `model`, its KV pool what the memory
    budget leaves."""
    from serving.engine.engine import LLMEngine
    from serving.engine.quantize import kv_cache_dtype
    from serving.engine.runner import kv_bytes_per_block

    model = prepared(model, tokenizer, step.quantization)
    bs = args.block_size
    seq_blocks = -(-(max(len(p) for p in prompts) + args.max_tokens + args.num_speculative_tokens) // bs)
    block_bytes = kv_bytes_per_block(model, bs, kv_cache_dtype(step.kv_cache_dtype, model.dtype))
    free = args.memory_budget_gb * 2**30 - weight_bytes(model)
    capacity = int(free // (block_bytes * seq_blocks))
    if capacity < 1:
        raise ValueError(f"--memory_budget_gb {args.memory_budget_gb} leaves no room for one sequence at {step.name}")
    num_seqs = min(capacity, args.max_num_seqs)
    options = dict(
        max_model_len=seq_blocks * bs,
        block_size=bs,
        num_kv_blocks=num_seqs * seq_blocks + 1,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs),
        attention_backend=step.backend,
        kv_cache_dtype=step.kv_cache_dtype,
        enable_prefix_caching=False,  # a warm-up pass must not leave the timed one cached prompts
        warmup=args.warmup in ("engine", "serve"),  # serve (spec_load): the engine's warm-up, a pass, the schedule
    )
    if args.compilation_cache_dir is not None:
        options["compilation_cache_dir"] = args.compilation_cache_dir
    if step.speculate:
        options |= dict(speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens)
        if step.threshold:
            options["speculative_batch_threshold"] = step.threshold
    engine = LLMEngine(model, tokenizer, EngineConfig.from_kwargs(**options))
    if proposer is not None:
        engine.spec.proposer = proposer
    return engine, capacity, weight_bytes(model)


class Trials:
    """Wraps a proposer's observe: accepted drafts and Bernoulli trials (per-token acceptance)."""

    def __init__(self, proposer):
        self.successes = self.trials = self.passes = 0
        self._observe = proposer.observe
        proposer.observe = self.observe

    def observe(self, request_id, num_draft, num_accepted):
        num_draft, num_accepted = int(num_draft), int(num_accepted)
        self.successes += num_accepted
        self.trials += num_accepted + (1 if num_accepted < num_draft else 0)
        self.passes += 1
        self._observe(request_id, num_draft, num_accepted)


def serve(engine, prompts, times, max_tokens: int) -> dict:
    """Runs the workload in real time; per request arrival, first-token and finish times (s), tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    n, nxt = len(prompts), 0
    rid_of: dict[str, int] = {}
    first, done = np.full(n, np.nan), np.full(n, np.nan)
    tokens = [[] for _ in range(n)]
    peak = 0
    t0 = time.perf_counter()
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and times[nxt] <= now:
            rid_of[engine.add_request(prompts[nxt], params)] = nxt
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, times[nxt] - (time.perf_counter() - t0)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - t0
        peak = max(peak, len(engine.scheduler.running))
        for o in outputs:
            i = rid_of[o.request_id]
            if o.new_token_ids and np.isnan(first[i]):
                first[i] = now
            tokens[i] += list(o.new_token_ids)
            if o.finished:
                done[i] = now
    return dict(first=first, done=done, tokens=tokens, peak=peak)


def warm(engine, prompts, max_tokens: int) -> None:
    """Compiles the shapes the timed pass meets, untimed: every prompt at once, request i generating
    max_tokens * (i + 1) / n tokens, so the batch shrinks one row at a time and the last runs to full length."""
    n = len(prompts)
    for i, p in enumerate(prompts):
        want = max(2, max_tokens * (i + 1) // n)
        engine.add_request(p, SamplingParams(max_tokens=want, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def warm_rows(engine) -> None:
    """Compiles what the engine's warm-up does not, untimed: the sampler and the small eager gathers of the sampled
    rows for every row count (b tiny requests for each b up to max_num_seqs; once per process, jit caches them)."""
    for b in range(1, engine.config.max_num_seqs + 1):
        for i in range(b):
            engine.add_request([100 + i] * 4, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()


def summarize(run: dict, times: np.ndarray, max_tokens: int) -> dict:
    latency = run["done"] - times
    ttft = run["first"] - times
    span = float(np.nanmax(run["done"]) - times[0])
    n = len(times)
    return dict(
        p50_latency_s=float(np.percentile(latency, 50)),
        p95_latency_s=float(np.percentile(latency, 95)),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        throughput_req_s=n / span,
        throughput_tok_s=n * max_tokens / span,
        peak_running=int(run["peak"]),
        seconds=span,
    )


# Quality -----------------------------------------------------------------------------------------------------------


def perplexity(model, tokenizer, step: Step, args) -> float:
    """Held-out code perplexity of the step's weights and KV numerics (float32 scoring of the same model)."""
    model = prepared(model, tokenizer, step.quantization)
    eval_bt = quant_quality.sequences(tokenizer, "code", "eval", args.quality_seq_len, args.quality_seqs)
    kv = None if step.kv_cache_dtype == "auto" else step.kv_cache_dtype
    return quant_quality.score(model, eval_bt, kv_dtype=kv)[0]["ppl"]


# Driver ------------------------------------------------------------------------------------------------------------


def load(args):
    """(model, tokenizer (a NullTokenizer for random weights), label)."""
    from checkpoints.loader import load_checkpoint
    from model.transformer import build_model, random_model

    dtype = jnp.dtype(args.dtype)
    if args.preset == "smollm2":
        ckpt = load_checkpoint(None)
        return build_model(ckpt.config, ckpt.params, dtype), ckpt.tokenizer, "SmolLM2-135M-Instruct (GGUF Q4_1)"
    cfg = ModelConfig.preset(args.preset)
    from checkpoints.tokenizer import NullTokenizer  # ids only: the engine streams no text

    return random_model(cfg, dtype, seed=0), NullTokenizer(), f"{cfg.name} shape, random weights"


def _same_program(a: Step, b: Step) -> bool:
    """Whether two steps run the same programs on this device (attention backends resolved)."""
    from pallas_kernels.backend import resolve_backend

    def key(s):
        return dataclasses.replace(s, name="", backend=resolve_backend(s.backend, "ragged_paged_attention"))

    return key(a) == key(b) and resolve_backend(a.backend, "paged_attention") == resolve_backend(
        b.backend, "paged_attention"
    )


def run(args, save=lambda result: None) -> dict:
    """The steps on one workload; `save(partial result)` after each step (a run cut short keeps what it measured)."""
    model, tokenizer, label = load(args)
    real = args.preset == "smollm2"  # real weights and text; else random weights, ids, replayed drafts
    prompts = workload_prompts(args, model, tokenizer)
    times = arrivals(args.num_requests, args.rate, args.seed)
    rows, recorded, quality = [], None, {}
    result = dict(
        model=label,
        device=f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        host=platform.node(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        args=vars(args),
        arrivals_s=times.tolist(),
        prompt_lens=[len(p) for p in prompts],
        steps=rows,
    )
    reuse = {}
    if args.reuse_rows:  # rows an earlier run of the same workload printed (JSON lines), e.g. to resume
        with open(args.reuse_rows) as f:
            reuse = {r["step"]: r for r in map(json.loads, f) if r.get("step")}
    for step in steps(args):
        if step.name in reuse:
            rows.append(dict(reuse[step.name], reused_from=args.reuse_rows))
            save(result)
            continue
        if rows and _same_program(step, steps(args)[len(rows) - 1]):
            # e.g. step 2 on CPU: the default attention backend there is the XLA reference, the baseline's program
            rows.append(dict(rows[-1], step=step.name, **dataclasses.asdict(step), same_program_as=rows[-1]["step"]))
            print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}), flush=True)
            save(result)
            continue
        proposer = None
        if step.speculate and not real:
            from serving.spec.proposers import ReplayProposer

            seqs = [p + o for p, o in zip(prompts, recorded)]
            proposer = ReplayProposer(seqs, [len(p) for p in prompts], args.replay_acceptance, model.cfg.vocab_size, 0)
        t0 = time.perf_counter()
        engine, capacity, wbytes = make_engine(model, tokenizer, step, args, prompts, proposer)
        build_s = time.perf_counter() - t0
        if args.warmup == "pass":
            warm(engine, prompts, args.max_tokens)
        warm_rows(engine)
        trials = Trials(engine.spec.proposer) if engine.spec is not None else None
        served = serve(engine, prompts, times, args.max_tokens)
        if step.name == "kv_int8":
            recorded = served["tokens"]  # the replay proposer's greedy continuations (same weights and KV)
        row = dict(
            step=step.name, **dataclasses.asdict(step), capacity=capacity, max_num_seqs=engine.config.max_num_seqs
        )
        row |= summarize(served, times, args.max_tokens) | dict(weight_bytes=wbytes, build_s=build_s)
        if trials is not None:
            row |= dict(acceptance=trials.successes / max(trials.trials, 1), verify_passes=trials.passes)
            row["proposer"] = "replay" if proposer is not None else "ngram"
        key = (step.quantization, step.kv_cache_dtype)
        if real and args.quality_seqs:
            if key not in quality:
                quality[key] = perplexity(model, tokenizer, step, args)
            row["ppl_code"] = quality[key]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
        save(result)
        del engine
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["steps"]
    names = [r["step"] for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].bar(x - 0.2, [r["p50_latency_s"] for r in rows], 0.4, label="p50")
    axes[0].bar(x + 0.2, [r["p95_latency_s"] for r in rows], 0.4, label="p95")
    axes[0].set_ylabel("latency (s)")
    axes[0].legend()
    axes[1].bar(x, [r["throughput_req_s"] for r in rows], color="tab:green")
    axes[1].set_ylabel("throughput (requests/s)")
    axes[2].bar(x - 0.2, [r["capacity"] for r in rows], 0.4, label="KV-bound concurrency")
    axes[2].bar(x + 0.2, [r["peak_running"] for r in rows], 0.4, label="peak running")
    axes[2].set_yscale("log")
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(x, names, rotation=30, ha="right")
    fig.suptitle(f"Worked example: {result['model']} on {result['device']}, {result['args']['rate']} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_flags(p)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    p.add_argument("--replay_acceptance", type=float, default=None, help="random weights: ReplayProposer's rate")
    p.add_argument("--kernel_backend", default="auto", help="steps 2+: auto (the default kernels) or a backend")
    p.add_argument("--num_steps", type=int, default=len(STEPS))
    p.add_argument("--quality_seqs", type=int, default=4, help="held-out code sequences scored (0: no quality)")
    p.add_argument("--quality_seq_len", type=int, default=256)
    p.add_argument(
        "--warmup",
        choices=("engine", "pass"),
        default="engine",
        help="engine: compile every bucket first; pass: run the workload once untimed first",
    )
    p.add_argument("--reuse_rows", default=None, help="JSON lines of steps measured by an earlier identical run")
    p.add_argument("--out", default="benchmarks/results/worked_example_cpu.json")
    p.add_argument("--png", default=None, help="default: --out with .png")
    args = p.parse_args(argv)
    if args.preset != "smollm2" and args.num_steps > 4 and args.replay_acceptance is None:
        raise ValueError("--replay_acceptance is needed for the speculative steps on random weights")
    if args.replay_acceptance is not None and not 0.0 <= args.replay_acceptance <= 1.0:
        raise ValueError(f"--replay_acceptance must be in [0, 1], got {args.replay_acceptance}")
    if args.rate <= 0 or args.num_requests < 1:
        raise ValueError("--rate must be > 0 and --num_requests >= 1")
    if args.compilation_cache_dir:
        from serving.engine.llm import enable_compilation_cache

        enable_compilation_cache(args.compilation_cache_dir)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save(result):
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
        plot(result, args.png or os.path.splitext(args.out)[0] + ".png")

    save(run(args, save))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
