"""Per-token cost of structured output on SmolLM2: the grammar mask on the host, on the device, and end to end.

    PYTHONPATH=. python benchmarks/structured_overhead.py --out benchmarks/results/structured_overhead_cpu.json

At each batch size (default 1 and 64) it times, median of --repeats:
  host_*_ms        per decode token for B constrained rows along a whole valid JSON document: the masks
                   (StructuredOutputs.bitmask, llguidance filling rows in parallel) and advancing each matcher
  sampler_ms       the jitted sampler with and without the packed bitmask (greedy, V = 49,152)
  step_ms          engine decode steps (decode_steps 1: the path constrained rows take) with every row
                   constrained by a schema whose long string keeps all rows decoding, against the same batch
                   unconstrained, and unconstrained with the multi-step loop (decode_steps 4); the three
                   alternate for --rounds rounds and each keeps its fastest
Greedy; float32; XLA attention. Writes one JSON with every figure.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from model.sampling import SamplingTensors
from serving.core.request import Constraint, Request, SamplingParams
from serving.engine.sampler import sample_rows
from serving.engine.structured import StructuredOutputs, sample_rows_masked

FLAGS = flags.FLAGS
flags.DEFINE_string("batches", "1,64", "batch sizes")
flags.DEFINE_integer("repeats", 20, "timed repetitions of the host and sampler measurements")
flags.DEFINE_integer("rounds", 3, "timed rounds of the engine configurations (alternating)")
flags.DEFINE_integer("decode_tokens", 16, "decode steps timed per engine configuration")
flags.DEFINE_string("out", "benchmarks/results/structured_overhead_cpu.json", "output JSON")

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 300, "maxLength": 400},
        "year": {"type": "integer", "minimum": 1000, "maximum": 3000},
    },
    "required": ["title", "year"],
    "additionalProperties": False,
}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def host_costs(tokenizer, vocab: int, eos, b: int) -> dict:
    """Host time per decode token for b constrained rows: their masks (one parallel fill) + each matcher's advance,
    along the tokens of a whole valid document (a fresh state every token, so nothing is served from a cache)."""
    so = StructuredOutputs(tokenizer, vocab, eos)
    c = Constraint.json_schema(SCHEMA)
    doc = tokenizer.encode(json.dumps({"title": "The history of the world in many words, " * 8, "year": 1987}))
    reqs = []
    for i in range(b):
        r = Request(f"r{i}", [1], SamplingParams(constraint=c))
        so.add(r.request_id, c)
        reqs.append(r)
    banned = np.full((b, 8), -1, np.int32)
    mask_s, advance_s = [], []
    for t in doc:
        t0 = time.perf_counter()
        _, dead = so.bitmask(reqs, b, banned)
        t1 = time.perf_counter()
        verdicts = [so.advance(r, [t]) for r in reqs]
        advance_s.append(time.perf_counter() - t1)
        mask_s.append(t1 - t0)
        assert not dead and all(v in (None, "stop") for v in verdicts), (dead, verdicts)
    return {
        "doc_tokens": len(doc),
        "host_mask_ms_per_token_mean": 1e3 * statistics.fmean(mask_s),
        "host_mask_ms_per_token_p50": 1e3 * statistics.median(mask_s),
        "host_mask_ms_per_token_max": 1e3 * max(mask_s),
        "host_advance_ms_per_token_mean": 1e3 * statistics.fmean(advance_s),
    }


def sampler_costs(vocab: int, b: int, repeats: int) -> dict:
    logits = jax.random.normal(jax.random.key(0), (b, vocab), jnp.float32)
    st = SamplingTensors.from_rows([{}] * b)
    banned = np.full((b, 8), -1, np.int32)
    mask = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, (b, -(-vocab // 32)), dtype=np.int64)
    mask = mask.astype(np.int32)
    plain = lambda: jax.block_until_ready(sample_rows(logits, st, None, None, banned))
    masked = lambda: jax.block_until_ready(sample_rows_masked(logits, st, None, None, banned, mask))
    return {"sampler_ms_plain": _median_ms(plain, repeats), "sampler_ms_masked": _median_ms(masked, repeats)}


def make_llms(max_batch: int) -> dict:
    """One LLM per decode_steps (1: the step path constrained rows take; 4: the multi-step loop)."""
    from serving.engine.llm import LLM

    return {
        k: LLM(
            max_model_len=256,
            attention_backend="xla",
            max_num_seqs=max_batch,
            max_num_batched_tokens=max(256, 16 * max_batch),
            decode_steps=k,
            block_size=16,
            num_kv_blocks=max(max_batch * 6, 16) + 8,
        )
        for k in (1, 4)
    }


def _timed_decode(engine, prompt, params, b: int, n_tokens: int) -> tuple[float, int]:
    """(seconds, tokens) of the decode steps of b identical requests, from their second token to n_tokens."""
    rids = [engine.add_request(prompt, params) for _ in range(b)]
    reqs = [engine.track(r).request for r in rids]
    while any(r.num_output_tokens < 2 for r in reqs):
        engine.step()  # prefill and the first decode step
    done0 = sum(r.num_output_tokens for r in reqs)
    t0 = time.perf_counter()
    while all(r.num_output_tokens < n_tokens for r in reqs):
        engine.step()
    dt = time.perf_counter() - t0
    done = sum(r.num_output_tokens for r in reqs) - done0
    assert not any(r.is_finished for r in reqs), "a row finished early: the timing would mix batch sizes"
    for r in rids:
        engine.abort(r)
    return dt, done


def step_costs(llms: dict, b: int, n_tokens: int, rounds: int) -> dict:
    """Decode cost per token of a row; the configurations alternate for `rounds` rounds (a shared host's load drifts)
    and each keeps its least disturbed round."""
    configs = [("unconstrained_loop4", 4, False), ("unconstrained_step", 1, False), ("constrained_step", 1, True)]
    best: dict[str, float] = {}
    for i in range(rounds + 1):
        for name, decode_steps, constrained in configs:
            llm = llms[decode_steps]
            prompt = llm.encode_prompt("Write a long title of a history book as JSON.", chat=True)
            c = Constraint.json_schema(SCHEMA) if constrained else None
            # Every row decodes the whole time: EOS ignored without a constraint; with one the schema's
            # 300-character string cannot end within n_tokens.
            params = SamplingParams(
                max_tokens=n_tokens + 8, temperature=0.0, constraint=c, ignore_eos=not constrained
            ).validate()
            dt, done = _timed_decode(llm.engine, prompt, params, b, n_tokens)
            if i:  # round 0 compiles every shape
                best[name] = min(best.get(name, float("inf")), 1e3 * dt / (done / b))
    out = {}
    for name, ms in best.items():
        out[f"step_ms_per_token_{name}"] = ms
        out[f"tokens_per_s_{name}"] = 1e3 * b / ms
    return out


def main(_):
    from checkpoints.loader import load_checkpoint

    ckpt = load_checkpoint()
    tokenizer, cfg = ckpt.tokenizer, ckpt.config
    results = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "rows": []}
    batches = [int(x) for x in FLAGS.batches.split(",")]
    llms = make_llms(max(batches))
    for b in batches:
        row = {"batch": b}
        row |= host_costs(tokenizer, cfg.vocab_size, cfg.eos_token_ids, b)
        row |= sampler_costs(cfg.vocab_size, b, FLAGS.repeats)
        row |= step_costs(llms, b, FLAGS.decode_tokens, FLAGS.rounds)
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
