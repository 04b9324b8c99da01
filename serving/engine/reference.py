"""The readable reference generation path: jitted prefill + a jitted decode loop over a contiguous KV cache.

    prompts --right-pad--> prefill [B, T_pad] --> logits at each row's last prompt token --> sample
            --> lax.while_loop: decode one token for every row per iteration until all rows stop

The paged engine (serving/engine/engine.py) is the product; this path is kept small and obviously correct, and the
engine's exactness tests compare against it token for token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.kv import ContiguousMeta, init_contiguous_cache
from model.sampling import SamplingTensors, sample
from model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class ReferenceOutput:
    token_ids: list[list[int]]  # generated ids per prompt (stop token included when one ended the row)
    logprobs: list[list[float]]


def _bucket(n: int, minimum: int = 16) -> int:
    """Next power of two >= n (bounds the number of compiled shapes)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(nnx.jit, static_argnames=("max_new",))
def _generate(
    model: Transformer, tokens_bt, lengths_b, st: SamplingTensors, stop_ids_s, max_new_b, caches, max_new: int
):
    b, t = tokens_bt.shape
    meta = ContiguousMeta()
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, caches = model(tokens_bt, positions, caches, meta, (lengths_b - 1)[:, None])
    tok, lp, _, _ = sample(logits[:, 0], st)
    out = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(tok)
    out_lp = jnp.zeros((b, max_new), jnp.float32).at[:, 0].set(lp)

    def stopped(tok_b, n_b):
        return jnp.isin(tok_b, stop_ids_s) | (n_b >= max_new_b)

    done = stopped(tok, jnp.ones_like(lengths_b))

    def cond(state):
        i, _, _, _, done, _ = state
        return (i < max_new) & ~jnp.all(done)

    def body(state):
        i, tok, out, out_lp, done, caches = state
        pos = (lengths_b + i - 1)[:, None]
        logits, caches = model(tok[:, None], pos, caches, meta, None)
        step_st = dataclasses.replace(st, step=st.step + i)
        new_tok, lp, _, _ = sample(logits[:, 0], step_st)
        new_tok = jnp.where(done, 0, new_tok)
        out = out.at[:, i].set(new_tok)
        out_lp = out_lp.at[:, i].set(lp)
        done = done | stopped(new_tok, jnp.full_like(lengths_b, i + 1))
        return i + 1, new_tok, out, out_lp, done, caches

    n, _, out, out_lp, done, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, out, out_lp, done, caches))
    return out, out_lp


def generate_reference(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampling: Sequence[dict],
    max_tokens: Sequence[int],
    stop_token_ids: Sequence[int],
    max_model_len: int | None = None,
) -> ReferenceOutput:
    """Generates for a batch of token-id prompts on a contiguous cache.

    Args:
      model: the decoder.
      prompts: token ids per prompt (non-empty).
      sampling: per-prompt dicts of SamplingTensors fields (temperature, top_k, top_p, min_p, seed).
      max_tokens: per-prompt generation limits.
      stop_token_ids: ids that end a row (EOS); the stop token is included in the output.
      max_model_len: context limit (defaults to the model's).

    Returns:
      ReferenceOutput with each row's tokens up to and including its stop token, or max_tokens of them.
    """
    limit = max_model_len or model.cfg.max_position_embeddings
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_tokens[i] > limit:
            raise ValueError(
                f"prompt {i}: {len(p)} prompt tokens + max_tokens {max_tokens[i]} exceed the context length {limit}"
            )
    b = len(prompts)
    t_pad = _bucket(max(len(p) for p in prompts))
    max_new = _bucket(max(max_tokens), 8)
    tokens = np.zeros((b, t_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    cfg = model.cfg
    caches = init_contiguous_cache(cfg.num_layers, b, t_pad + max_new, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    stop = np.array(list(stop_token_ids) or [-1], np.int32)
    out, out_lp = _generate(
        model,
        jnp.asarray(tokens),
        jnp.asarray([len(p) for p in prompts], jnp.int32),
        SamplingTensors.from_rows(sampling),
        jnp.asarray(stop),
        jnp.asarray(max_tokens, jnp.int32),
        caches,
        max_new=max_new,
    )
    out, out_lp = np.asarray(out), np.asarray(out_lp)
    ids, lps = [], []
    for i in range(b):
        row = out[i, : max_tokens[i]].tolist()
        end = next((j + 1 for j, t in enumerate(row) if t in set(stop_token_ids)), len(row))
        ids.append(row[:end])
        lps.append(out_lp[i, :end].tolist())
    return ReferenceOutput(ids, lps)
