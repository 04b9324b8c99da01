"""Fine-tune, serve, score, policy-gradient step, swap weights, serve again: SmolLM2 in one process.

    load SmolLM2 (float32) --> SFT: a few optax steps on a local licence text (the last `train_layers` blocks)
      --> LLM.from_params(config, params)            the paged engine over the fine-tuned weights
      --> each iteration:
            llm.generate(k samples per prompt)        token ids, logprobs of the sampled tokens, seeds (replayable)
            llm.logprobs(prompts, samples)            the behaviour policy's logprobs: batched, prompts shared
            reward = share of sample tokens that occur in the text;  advantage = reward - mean
            one policy-gradient step on the trainer:  loss = -sum(A * exp(logp_theta - logp_engine)) / tokens
            llm.update_weights(model)                 in place: no recompilation, prefix cache cleared
      --> llm.generate again (from the last weights)

The trainer and the engine share one JAX runtime: no checkpoint is written and nothing is reloaded. Gradients
flow through the model (model/transformer.py with the contiguous NoCache attention); the engine's loop
(scheduling, paged KV, sampling) is not differentiable and is only ever called to produce data.

One jitted train step serves both phases (SFT is the same objective with logp_engine = stop_gradient(logp_theta)
and A = 1), so it compiles once.

Run:  python examples/rl_loop.py --sft_steps 4 --iterations 3 --max_tokens 16
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from checkpoints.loader import load_checkpoint
from model.kv import NoCache
from model.transformer import Transformer, build_model
from serving.engine.llm import LLM

TEXT = "/usr/share/common-licenses/Apache-2.0"


def _is_trainable(first: int):
    """nnx filter: parameters of blocks >= first and the final norm (gradients flow back only that far)."""

    def f(path, value) -> bool:
        if not isinstance(value, nnx.Param):
            return False
        return path[0] == "final_norm" or (len(path) > 1 and path[0] == "layers" and int(path[1]) >= first)

    return f


def _token_logprobs(model: Transformer, tokens_bt, lengths_b):
    """log p(tokens[b, t+1] | tokens[b, :t+1]) [B, T-1] (teacher forcing over right-padded rows)."""
    b, t = tokens_bt.shape
    logits, _ = model(tokens_bt, jnp.broadcast_to(jnp.arange(t), (b, t)), None, NoCache(lengths_b))
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, tokens_bt[:, 1:, None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def train_step(graphdef, opt, train, frozen, opt_state, batch):
    """One optax step on `train`; batch = (tokens [B, T], lengths [B], coef [B, T-1], old [B, T-1], use_old [])."""
    tokens, lengths, coef, old, use_old = batch

    def loss_fn(train):
        lp = _token_logprobs(nnx.merge(graphdef, train, frozen), tokens, lengths)
        ref = jnp.where(use_old, old, jax.lax.stop_gradient(lp))
        return -jnp.sum(coef * jnp.exp(lp - ref)), lp

    (loss, lp), grads = jax.value_and_grad(loss_fn, has_aux=True)(train)
    updates, opt_state = opt.update(grads, opt_state, train)
    return optax.apply_updates(train, updates), opt_state, loss, lp


def _pad(rows, length):
    tokens = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, np.asarray([len(r) for r in rows], np.int32)


def sft_batches(ids, batch, length, steps):
    """`steps` batches of `batch` windows of `length` tokens from the text, next-token targets everywhere."""
    starts = np.random.default_rng(0).integers(0, len(ids) - length, (steps, batch))
    for row in starts:
        tokens, lengths = _pad([ids[s : s + length] for s in row], length)
        coef = np.full((batch, length - 1), 1.0 / (batch * (length - 1)), np.float32)
        yield tokens, lengths, coef, np.zeros_like(coef), np.bool_(False)


def pg_batch(prompts, samples, old_logprobs, rewards, length):
    """Rows prompt + sample; coefficients A / tokens on the positions that predict sample tokens."""
    adv = np.asarray(rewards, np.float32) - np.mean(rewards)
    tokens, lengths = _pad([list(p) + list(s) for p, s in zip(prompts, samples)], length)
    coef = np.zeros((len(prompts), length - 1), np.float32)
    old = np.zeros_like(coef)
    n = sum(len(s) for s in samples)
    for i, (p, s, lp) in enumerate(zip(prompts, samples, old_logprobs)):
        coef[i, len(p) - 1 : len(p) - 1 + len(s)] = adv[i] / n
        old[i, len(p) - 1 : len(p) - 1 + len(s)] = lp
    return tokens, lengths, coef, old, np.bool_(True)


def _sample_logprobs(lp_bt, prompts, samples):
    return [np.asarray(lp_bt[i, len(p) - 1 : len(p) - 1 + len(s)]) for i, (p, s) in enumerate(zip(prompts, samples))]


@dataclasses.dataclass
class Trainer:
    """The trainer's side: the split module (trainable blocks, frozen rest) and its optax state."""

    graphdef: nnx.GraphDef
    opt: optax.GradientTransformation
    train: nnx.State
    frozen: nnx.State
    opt_state: optax.OptState

    @classmethod
    def create(cls, model: Transformer, train_layers: int, learning_rate: float) -> Trainer:
        first = model.cfg.num_layers - train_layers
        graphdef, train, frozen = nnx.split(model, _is_trainable(first), ...)
        opt = optax.adam(learning_rate)
        return cls(graphdef, opt, train, frozen, opt.init(train))

    def step(self, batch) -> np.ndarray:
        """One optax step; returns the token logprobs [B, T-1] at the weights before it."""
        self.train, self.opt_state, _, lp = train_step(
            self.graphdef, self.opt, self.train, self.frozen, self.opt_state, batch
        )
        return np.asarray(lp)

    def module(self) -> Transformer:
        return nnx.merge(self.graphdef, self.train, self.frozen)


def rl_round(llm: LLM, trainer: Trainer, prompts, vocab: set, max_tokens: int, seq_len: int) -> dict:
    """generate -> score -> one policy-gradient step -> update_weights; returns what the round saw."""
    outs = llm.generate(prompts, max_tokens=max_tokens, temperature=1.0, logprobs=0, ignore_eos=True)
    samples = [o.token_ids for o in outs]
    scored = [s.token_logprobs for s in llm.logprobs(prompts, samples)]
    rewards = [float(np.mean([t in vocab for t in s])) for s in samples]
    lp = trainer.step(pg_batch(prompts, samples, scored, rewards, seq_len))
    trainer_lp = _sample_logprobs(lp, prompts, samples)  # at the weights that sampled
    gap = max(float(np.abs(a - b).max()) for a, b in zip(trainer_lp, scored))
    llm.update_weights(trainer.module())
    seeds = [o.seed for o in outs]
    return dict(reward=float(np.mean(rewards)), seeds=seeds, trainer_engine_gap=gap, samples=samples, scored=scored)


def run(
    sft_steps: int = 4,
    iterations: int = 3,
    num_prompts: int = 2,
    samples_per_prompt: int = 2,
    prompt_tokens: int = 12,
    max_tokens: int = 16,
    seq_len: int = 48,
    train_layers: int = 2,
    learning_rate: float = 1e-4,
    text: str = TEXT,
    log=print,
    **engine_options,
) -> dict:
    """Runs the loop; returns what the test checks (see tests/test_research.py) and a few curves."""
    t0 = time.perf_counter()
    ckpt = load_checkpoint(None)
    cfg, tok = ckpt.config, ckpt.tokenizer
    with open(text, encoding="utf-8") as f:
        ids = tok.encode(f.read())
    trainer = Trainer.create(build_model(cfg, ckpt.params, jnp.float32), train_layers, learning_rate)
    batch_size = num_prompts * samples_per_prompt
    sft_losses = []
    for batch in sft_batches(ids, batch_size, seq_len, sft_steps):
        sft_losses.append(float(-(batch[2] * trainer.step(batch)).sum()))  # cross-entropy before the step
    log(
        f"SFT: {sft_steps} steps, cross-entropy {sft_losses[0]:.3f} -> {sft_losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)"
    )

    options = dict(max_num_seqs=batch_size, max_model_len=2 * seq_len, block_size=8) | engine_options
    llm = LLM.from_params(cfg, trainer.module(), tokenizer=tok, **options)
    starts = np.random.default_rng(1).integers(0, len(ids) - prompt_tokens, num_prompts)
    prompts = [ids[s : s + prompt_tokens] for s in starts for _ in range(samples_per_prompt)]
    history, compiles = [], []
    for it in range(iterations):
        history.append(rl_round(llm, trainer, prompts, set(ids), max_tokens, seq_len))
        compiles.append((llm.engine.runner.num_compiles, train_step._cache_size()))
        log(
            f"round {it}: mean reward {history[-1]['reward']:.3f}, trainer-engine gap {history[-1]['trainer_engine_gap']:.1e}"
        )
    final = llm.generate(prompts, max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    log(f"done in {time.perf_counter() - t0:.0f} s; sample: {final[0].text!r}")
    return dict(
        llm=llm,
        engine_options=options,
        model=trainer.module(),
        prompts=prompts,
        final=final,
        history=history,
        sft_losses=sft_losses,
        compiles_after_first=compiles[0],
        compiles_at_end=(llm.engine.runner.num_compiles, train_step._cache_size()),
    )


def main(argv) -> None:
    del argv
    run(
        sft_steps=FLAGS.sft_steps,
        iterations=FLAGS.iterations,
        max_tokens=FLAGS.max_tokens,
        learning_rate=FLAGS.learning_rate,
        text=FLAGS.text,
    )


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_integer("sft_steps", 4, "optax steps of supervised fine-tuning on the text")
    flags.DEFINE_integer("iterations", 3, "generate / score / policy-gradient / update_weights rounds")
    flags.DEFINE_integer("max_tokens", 16, "tokens sampled per rollout")
    flags.DEFINE_float("learning_rate", 1e-4, "Adam learning rate")
    flags.DEFINE_string("text", TEXT, "local text to fine-tune on and to reward staying close to")
    FLAGS = flags.FLAGS
    app.run(main)
