"""Batch-1 tokens/s with and without speculative decoding, per proposer and domain, through the engine.

    PYTHONPATH=. python benchmarks/spec_engine.py --max_tokens 48 --out benchmarks/results/spec_engine_cpu.json

One LLM (SmolLM2 by default, greedy) serves every method: plain decoding (`off`, the engine's default path with
`decode_steps`-long on-device loops), then each proposer swapped in as the engine's SpecDecoder over the same
runner: `ngram` (prompt lookup), `self` (the target's first --self_layers layers + its head, sharing the target's
KV), `draft` (a separate draft model with its own paged KV: the target's first --draft_layers layers as a copy; or
--draft_model, a checkpoint path, e.g. SmolLM2 itself for the acceptance ceiling), `medusa` (trained heads on the
target's last hidden state, --medusa_heads: a checkpoint dir from serving/train_heads.py; --k <= its heads). `ngram` is the
host path (one host round trip per verify pass); `ngram_device` drafts, verifies and accepts inside the on-device
decode loop (serving/spec/device_loop.py, the engine's default), and `medusa_device`, `self_device` and
`draft_device` do the same with the heads and the draft models (each the engine's default for its method). Prompts are the Lab 02 ones
(benchmarks/spec_acceptance.py: stdlib code, licence prose, copy-heavy chat turns). Requests run one at a time
(batch 1); every method runs all its requests twice and the second pass is timed (the first compiles). Reported per method and domain:
decode tokens/s (generated tokens after the first / time from first to last token), speedup over `off`,
acceptance rate and mean emitted tokens per verify pass (SpecDecoder counters), and whether the tokens equal
`off`'s (greedy: they must).

--random_weights PRESET (e.g. llama3_8b, smollm2_135m) replaces the checkpoint by random bf16 weights of that shape
(no tokenizer: token-id prompts, domains `copy` = a random 48-token block repeated 4 times and `free` = random ids);
greedy decoding of random weights falls into cycles, which prompt lookup then drafts. The acceptance that results is
reported with the speed: there it is an outcome of the weights, not of the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import subprocess
import time

from benchmarks.spec_acceptance import build_prompts
from serving.engine.llm import LLM
from serving.spec.draft_model import ModelDraftProposer, make_model_proposer, runner_like, truncated_model
from serving.spec.head_proposer import MedusaProposer
from serving.spec.policy import SpecPolicy
from serving.spec.verify import SpecDecoder, policy_config


def _decoders(llm: LLM, args) -> dict:
    """method -> SpecDecoder (None: plain decoding) over the LLM's engine."""
    engine, model, k = llm.engine, llm.model, args.k
    r = engine.runner
    spec = engine.config.speculative

    def decoder(proposer):
        policy = SpecPolicy(policy_config(k, 0))
        return SpecDecoder(engine.scheduler, engine.runner, engine.sampler, engine.outputs, proposer, k, policy)

    methods = set(args.methods.split(","))
    out = dict(off=None, ngram=engine.spec, ngram_device=engine.spec)
    if {"self", "self_device"} & methods:
        self_spec = dataclasses.replace(spec, method="self", speculative_draft_layers=args.self_layers)
        out["self"] = out["self_device"] = decoder(make_model_proposer("self", r, model, self_spec, model.dtype))
    if {"draft", "draft_device"} & methods and args.draft_model:
        draft_spec = dataclasses.replace(spec, method="draft", speculative_model=args.draft_model)
        out["draft"] = decoder(make_model_proposer("draft", r, model, draft_spec, model.dtype))
    elif {"draft", "draft_device"} & methods:
        out["draft"] = decoder(ModelDraftProposer(runner_like(r, truncated_model(model, args.draft_layers)), "draft"))
    if "draft" in out:
        out["draft_device"] = out["draft"]  # the same decoder, on the device loop
    if {"medusa", "medusa_device"} & methods:
        from model.medusa import load_heads

        if not args.medusa_heads:
            raise SystemExit("--methods medusa needs --medusa_heads (a checkpoint dir from serving/train_heads.py)")
        heads = decoder(MedusaProposer(load_heads(args.medusa_heads)[0], r, k))
        out |= dict(medusa=heads, medusa_device=heads)  # medusa_device: drafting inside the on-device loop
    unknown = methods - set(out)
    if unknown:
        raise SystemExit(f"unknown --methods {sorted(unknown)}; choose from {sorted(out)}")
    return out


class _CompileCounter(logging.Handler):
    """Counts XLA compilations (jax_log_compiles' "Finished XLA compilation" records): a timed pass must have none."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        self.count += "Finished XLA compilation" in record.getMessage()


COMPILES = _CompileCounter()


def count_compiles() -> None:
    """Turns on jax_log_compiles and routes its records to COMPILES (counted, not printed)."""
    import jax

    jax.config.update("jax_log_compiles", True)
    for name in ("jax._src.dispatch", "jax._src.interpreters.pxla"):
        logger = logging.getLogger(name)
        logger.addHandler(COMPILES)
        logger.propagate = False


def _run(llm: LLM, spec, prompts: list[list[int]], max_tokens: int, device_loop: bool = False) -> dict:
    engine = llm.engine
    compiles = COMPILES.count
    engine.spec = spec
    engine.spec_loops.enabled = device_loop  # n-gram / medusa inside the on-device loop, or one round trip a pass
    loops = engine.spec_loops.num_loops
    before = spec.counters.as_dict() if spec is not None else None
    tokens, seconds, outs = 0, 0.0, []
    for ids in prompts:
        (o,) = engine.generate([None], [ids], max_tokens=max_tokens, temperature=0.0)
        n, dt = len(o.token_ids), o.metrics["e2e_s"] - o.metrics["ttft_s"]
        tokens, seconds = tokens + n - 1, seconds + dt
        outs.append(list(o.token_ids))
    row = dict(decode_tokens=tokens, decode_s=round(seconds, 3), tokens_per_s=round(tokens / seconds, 2), outputs=outs)
    row["device_spec_loops"] = engine.spec_loops.num_loops - loops
    row["compiles"] = COMPILES.count - compiles  # in this pass (the timed one should show 0)
    if spec is not None:
        after = spec.counters.as_dict()
        d = {key: after[key] - before[key] for key in ("passes", "drafted", "accepted", "emitted")}
        d["acceptance_rate"] = round(d["accepted"] / d["drafted"], 4) if d["drafted"] else 0.0
        d["mean_emitted_per_pass"] = round(d["emitted"] / d["passes"], 3) if d["passes"] else 0.0
        row.update(d)
    return row


def _traced(llm: LLM, spec, domains: dict, args, method: str) -> dict:
    """One domain's requests again under the profiler: wall time, passes and the GPU's busy time
    (benchmarks/engine_core.py device_timeline), so a pass's cost splits into device work and host gaps."""
    import jax

    from benchmarks.engine_core import device_timeline

    domain = next(iter(domains))
    trace_dir = f"{args.trace_dir}/{method}"
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    row = _run(llm, spec, domains[domain], args.max_tokens, method.endswith("_device"))
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    row.pop("outputs")
    passes = row.get("passes") or 0
    per_pass = round(1e3 * wall / passes, 3) if passes else None
    summary = dict(domain=domain, wall_s=round(wall, 4), passes=passes, wall_ms_per_pass=per_pass)
    return summary | dict(decode_tokens=row["decode_tokens"]) | device_timeline(trace_dir)


def _id_prompts(vocab: int, n: int) -> dict[str, list[list[int]]]:
    """Token-id prompts for random weights: `copy` (a random 48-token block, four times) and `free` (192 ids)."""
    import numpy as np

    rng = np.random.default_rng(0)
    copy = [(rng.integers(100, vocab, 48).tolist() * 4) for _ in range(n)]
    return dict(copy=copy, free=[rng.integers(100, vocab, 192).tolist() for _ in range(n)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max_tokens", type=int, default=48)
    ap.add_argument("--prompt_chars", type=int, default=600)
    ap.add_argument("--prompts_per_domain", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (the policy's top tier)")
    ap.add_argument("--self_layers", type=int, default=15)
    ap.add_argument("--draft_layers", type=int, default=8)
    ap.add_argument("--draft_model", default=None, help="a draft checkpoint instead of the truncated copy")
    ap.add_argument("--decode_steps", type=int, default=8)
    ap.add_argument("--attention_backend", default=None)
    ap.add_argument("--medusa_heads", default=None, help="heads checkpoint dir (python -m serving.train_heads)")
    ap.add_argument(
        "--methods",
        default="off,ngram,self,draft",
        help="also: ngram_device, self_device, draft_device, medusa, medusa_device (need --medusa_heads)",
    )
    ap.add_argument("--random_weights", default=None, help="a ModelConfig preset: random weights of its shape")
    ap.add_argument(
        "--dtype",
        default=None,
        help="model dtype (default: bfloat16 on an accelerator or with --random_weights, else the engine's float32: "
        "in f32 on the H200 a verify row's ragged-kernel tile made speculation 3x slower than off, 2026-12-03)",
    )
    ap.add_argument("--max_num_seqs", type=int, default=4, help="rows per step (batch-1 runs need 1: fewer buckets)")
    ap.add_argument(
        "--warmup",
        choices=("engine", "pass"),
        default="engine",
        help="engine: compile every bucket first (the engine's warm-up); pass: only what the untimed pass meets",
    )
    ap.add_argument("--out", default="benchmarks/results/spec_engine_cpu.json")
    ap.add_argument(
        "--trace_dir", default="", help="also profile each method's code requests once: GPU busy vs wall per pass"
    )
    args = ap.parse_args()
    import jax

    count_compiles()  # per pass

    options = dict(
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=256,
        num_kv_blocks=160,
        decode_steps=args.decode_steps,
        warmup=None if args.warmup == "engine" else False,  # None: the engine's default (on for accelerators)
    )
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.dtype is None and (args.random_weights or jax.default_backend() != "cpu"):
        args.dtype = "bfloat16"
    if args.dtype:
        options["dtype"] = args.dtype
    spec_options = dict(speculative_method="ngram", num_speculative_tokens=args.k)
    if args.random_weights:
        import jax.numpy as jnp

        from model.config import ModelConfig
        from model.transformer import random_model

        cfg = ModelConfig.preset(args.random_weights)
        model = random_model(cfg, jnp.dtype(args.dtype), seed=0)
        llm = LLM.from_model(model, None, copy=False, **options, **spec_options)
        domains = _id_prompts(cfg.vocab_size, args.prompts_per_domain)
    else:
        llm = LLM(args.model, **spec_options, **options)
        domains = {
            d: [llm.encode_prompt(text, chat=chat) for text, chat in items[: args.prompts_per_domain]]
            for d, items in build_prompts(args.prompt_chars).items()
        }
    decoders = _decoders(llm, args)
    methods = args.methods.split(",")
    result = dict(
        command="PYTHONPATH=. python benchmarks/spec_engine.py "
        + " ".join(f"--{k}={v}" for k, v in vars(args).items()),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        host=f"{platform.processor() or platform.machine()}, {platform.system()}",
        backend=llm.engine.runner.backend or "default",
        model=llm.name,
        methods={},
    )
    for m in methods:
        dev = m.endswith("_device")  # ngram_device, medusa_device: the on-device speculative loop
        for p in domains.values():  # a first, untimed pass compiles every shape these requests meet
            _run(llm, decoders[m], p, args.max_tokens, dev)
        result["methods"][m] = {d: _run(llm, decoders[m], p, args.max_tokens, dev) for d, p in domains.items()}
        print(
            m, {d: (r["tokens_per_s"], r.get("acceptance_rate")) for d, r in result["methods"][m].items()}, flush=True
        )
        if args.trace_dir:  # where a pass's time goes: the device timeline's busy share of the traced window
            result.setdefault("traces", {})[m] = _traced(llm, decoders[m], domains, args, m)
            print(m, "trace", json.dumps(result["traces"][m])[:600], flush=True)
    base = result["methods"].get("off")
    for per in result["methods"].values():
        for d, r in per.items():
            if base is not None:
                r["speedup"] = round(r["tokens_per_s"] / base[d]["tokens_per_s"], 3)
                r["identical_to_off"] = r["outputs"] == base[d]["outputs"]
    for per in result["methods"].values():
        for r in per.values():
            r.pop("outputs")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {
                m: {
                    d: {
                        k: r.get(k)
                        for k in (
                            "tokens_per_s",
                            "speedup",
                            "acceptance_rate",
                            "mean_emitted_per_pass",
                            "identical_to_off",
                            "device_spec_loops",
                            "compiles",
                        )
                    }
                    for d, r in per.items()
                }
                for m, per in result["methods"].items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
