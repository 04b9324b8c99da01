"""Speculative decoding's exact accept/reject rule, and the processed target distribution it must preserve.

A proposer (serving/spec/proposers.py) drafts up to k tokens per row with their draft probabilities q; one target
pass over the row's k+1 query tokens gives the target probabilities p at every position; `rejection_sample` turns
(p, q, drafts) into the tokens the row emits this step: the accepted prefix of the drafts, then one more token.

    query tokens      [last, d0, d1, ..., d_{k-1}]          (k = num_draft[b], padded to k_max)
    target_probs      [p0,   p1, p2, ..., p_k]              p_i = target(. | context, d_0..d_{i-1})
    draft_probs       [q0,   q1, ..., q_{k-1}]              q_i = draft(. | context, d_0..d_{i-1}), d_i ~ q_i
    emitted           [d0, ..., d_{n-1}, y]                 n = accepted prefix, y from the residual or p_k

The rule (Leviathan et al. 2022; Chen et al. 2023), position by position, stopping at the first rejection:

  accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
  on rejection emit y ~ norm(max(0, p_i - q_i)) and stop;
  if all k drafts are accepted, emit the bonus y ~ p_k.

Why the output is exactly the target's distribution (one position; induction over positions gives the joint):
  P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) norm(max(0, p - q))(x)
            = min(q(x), p(x))       + (1 - sum_y min(q, p)(y)) (p(x) - min(q, p)(x)) / sum_y (p - min(q, p))(y)
            = min(q(x), p(x))       + p(x) - min(q(x), p(x))       (since sum_y (p - min(q, p)) = 1 - sum_y min(q, p))
            = p(x).
Given acceptance, the emitted prefix equals the drafted prefix, so p_{i+1} (computed from the drafts) is the target's
conditional for the next position: the chain of per-position identities is the joint identity.

Edge cases, each without NaN:
  * Acceptance is tested as `u * q(x) < p(x)` with u ~ U[0, 1), which is `u < p/q` without the division. At
    q(x) = 0 (a draft that proposes a token it gives no mass, e.g. an underflowed probability) this is the limit
    q -> 0+ of min(1, p/q): accept iff p(x) > 0. A token the target gives no mass (p(x) = 0) is never accepted, so
    no token outside the target's (top-k/top-p-processed) support is ever emitted. Under a proposer whose tokens
    really are drawn from its q the event q(x) = 0 has probability zero, so the choice does not touch exactness.
  * Deterministic proposers (n-gram, greedy drafts) pass `draft_probs=None`: q is one-hot at the draft token, so
    acceptance is with probability p(x) and the residual is p with x removed. (They must not pass a softmax they did
    not sample from: the identity holds only for the q the tokens were actually drawn from.)
  * The residual mass sum max(0, p - q) equals the rejection probability, so a rejection with (numerically) zero
    residual happens only by float error (p == q up to rounding); below MIN_RESIDUAL_MASS the row draws from p.
  * Greedy is the one-hot case: with p one-hot at argmax a, a draft is accepted iff it is a, the residual and the
    bonus are one-hot at a, so the output is exactly the target's argmax chain.

Randomness is per row: row b draws only from keys[b] (u from fold_in(keys[b], 1), the final token by Gumbel-max
from keys[b] itself, as model/sampling.py does). With keys from `row_keys(seed, step)` a seeded request's tokens do
not depend on what else shares the batch, and a row with num_draft = 0 draws the same token that
`model.sampling.sample` draws with the same seed and step (up to float rounding of the log of the softmax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.sampling import SamplingTensors, filter_logits
from serving.spec.policy import expected_tokens

__all__ = ["MIN_RESIDUAL_MASS", "expected_tokens_per_pass", "processed_target_probs", "rejection_sample", "row_keys"]

MIN_RESIDUAL_MASS = 1e-6  # below this the residual is float error: draw from p instead


def row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    """Per-row typed keys [B] from uint32 seeds [B] and int32 steps [B], derived as model/sampling.py does."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, step)


def _as_row_keys(key: jax.Array, b: int) -> jax.Array:
    """A typed key array [B]: one key per row, from a single key (folded with the row index) or [B] keys."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
            raise ValueError(
                f"key: expected a typed PRNG key or raw uint32 [..., 2] key data, got {key.dtype} {key.shape}"
            )
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
    if key.shape != (b,):
        raise ValueError(f"key: expected one key or one per row (shape ({b},)), got shape {key.shape}")
    return key


def _check_shapes(target_probs, draft_probs, draft_tokens, num_draft) -> tuple[int, int, int]:
    if target_probs.ndim != 3:
        raise ValueError(f"target_probs: expected [B, k+1, V], got shape {target_probs.shape}")
    b, k1, v = target_probs.shape
    if draft_tokens.shape != (b, k1 - 1):
        raise ValueError(f"draft_tokens: expected shape {(b, k1 - 1)}, got {draft_tokens.shape}")
    if draft_probs is not None and draft_probs.shape != (b, k1 - 1, v):
        raise ValueError(f"draft_probs: expected shape {(b, k1 - 1, v)} or None, got {draft_probs.shape}")
    if num_draft.shape != (b,):
        raise ValueError(f"num_draft: expected shape {(b,)}, got {num_draft.shape}")
    return b, k1 - 1, v


@jax.jit
def rejection_sample(
    target_probs: jax.Array,
    draft_probs: jax.Array | None,
    draft_tokens: jax.Array,
    num_draft: jax.Array,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Accepts a prefix of each row's drafts and samples one more token, preserving the target distribution exactly.

    Args:
      target_probs: float32 [B, k+1, V], the processed target distribution at each query position
        (`processed_target_probs`); row b uses positions 0..num_draft[b].
      draft_probs: float32 [B, k, V], the distribution each draft token was drawn from; None for deterministic
        proposers (q one-hot at the draft token).
      draft_tokens: int32 [B, k]; row b's drafts are draft_tokens[b, :num_draft[b]] (the rest is ignored).
      num_draft: int32 [B] in [0, k]; 0 is a plain decode row.
      key: one PRNG key, or one per row [B] (`row_keys(seed, step)`: reproducible per request).

    Returns:
      (tokens int32 [B, k+1], num_emitted int32 [B] in [1, num_draft + 1]): row b emits tokens[b, :num_emitted[b]]
      (the accepted drafts, then the residual or bonus token); later positions hold -1.
    """
    b, k, v = _check_shapes(target_probs, draft_probs, draft_tokens, num_draft)
    keys = _as_row_keys(key, b)
    target_probs = target_probs.astype(jnp.float32)
    draft_tokens = draft_tokens.astype(jnp.int32)
    num_draft = jnp.clip(num_draft.astype(jnp.int32), 0, k)  # values are not checkable under jit: clamp
    rows = jnp.arange(b)

    u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 1), (k,), jnp.float32))(keys)  # [B, k]
    gumbel = jax.vmap(lambda kk: jax.random.gumbel(kk, (v,), jnp.float32))(keys)  # [B, V]
    safe_tok = jnp.clip(draft_tokens, 0, v - 1)
    p_x = jnp.take_along_axis(target_probs[:, :k], safe_tok[..., None], axis=-1)[..., 0]  # [B, k]
    if draft_probs is None:
        q_x = jnp.ones_like(p_x)
    else:
        draft_probs = draft_probs.astype(jnp.float32)
        q_x = jnp.take_along_axis(draft_probs, safe_tok[..., None], axis=-1)[..., 0]  # [B, k]
    accept = (u * q_x < p_x) & (jnp.arange(k)[None, :] < num_draft[:, None])  # [B, k]
    n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)  # [B]
    rejected = n_acc < num_draft

    p_last = target_probs[rows, n_acc]  # [B, V]: p at the first rejected position, or the bonus position
    at = jnp.minimum(n_acc, max(k - 1, 0))
    if k == 0:
        residual = jnp.zeros_like(p_last)
    elif draft_probs is None:
        residual = p_last * (jnp.arange(v)[None, :] != safe_tok[rows, at][:, None])
    else:
        residual = jnp.maximum(p_last - draft_probs[rows, at], 0.0)
    use_residual = rejected & (jnp.sum(residual, axis=-1) > MIN_RESIDUAL_MASS)
    dist = jnp.where(use_residual[:, None], residual, p_last)  # [B, V], unnormalised: Gumbel-max needs no norm
    last_tok = jnp.argmax(jnp.log(dist) + gumbel, axis=-1).astype(jnp.int32)  # log(0) = -inf: never drawn

    pos = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([draft_tokens, jnp.full((b, 1), -1, jnp.int32)], axis=1)  # [B, k+1]
    tokens = jnp.where(pos < n_acc[:, None], padded, -1)
    tokens = jnp.where(pos == n_acc[:, None], last_tok[:, None], tokens)
    return tokens, n_acc + 1


@jax.jit
def processed_target_probs(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """The distribution the sampler draws from, per row and position: softmax of the temperature-scaled,
    top-k/top-p/min-p-filtered logits (model.sampling.filter_logits); rows with temperature 0 are one-hot at argmax.

    Args:
      logits: float32 [B, V] or [B, T, V] (T = k+1 query positions of a verify row; every position of row b uses
        row b's parameters). Penalties and banned ids, which depend on the tokens before each position, must
        already be applied.
      st: per-row sampling parameters [B].

    Returns:
      float32 probabilities of the same shape as `logits`.
    """
    if logits.ndim not in (2, 3):
        raise ValueError(f"logits: expected [B, V] or [B, T, V], got shape {logits.shape}")
    squeeze = logits.ndim == 2
    l_btv = (logits[:, None] if squeeze else logits).astype(jnp.float32)
    b, t, v = l_btv.shape
    if st.temperature.shape != (b,):
        raise ValueError(f"st: expected per-row parameters of shape ({b},), got {st.temperature.shape}")
    st_rows = jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), t, axis=0), st)  # [B*T]
    flat = l_btv.reshape(b * t, v)
    probs = jax.nn.softmax(filter_logits(flat, st_rows), axis=-1)
    greedy = jax.nn.one_hot(jnp.argmax(flat, axis=-1), v, dtype=jnp.float32)
    probs = jnp.where(st_rows.temperature[:, None] > 0, probs, greedy).reshape(b, t, v)
    return probs[:, 0] if squeeze else probs


def expected_tokens_per_pass(acceptance: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): mean tokens one target pass emits with k drafts accepted i.i.d. with rate a."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return expected_tokens(acceptance, k)
