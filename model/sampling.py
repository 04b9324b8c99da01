"""Token sampling on device: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every row of a batch carries its own parameters (`SamplingTensors`), so one compiled function serves any mix of
greedy and sampled requests. Randomness is per request: row b draws with `fold_in(key(seed_b), step_b)` where
step_b is the number of tokens that request has generated, so a seeded request produces the same tokens whatever
else shares its batch. Sampling is Gumbel-max over the filtered, temperature-scaled logits, which equals drawing
from their softmax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    """Per-row sampling parameters, each [B]. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seed: jax.Array  # uint32
    step: jax.Array  # int32, tokens generated so far by the row's request

    @classmethod
    def from_rows(cls, rows: Sequence[dict]) -> SamplingTensors:
        """Host-side constructor from dicts with the field names (missing fields take neutral values)."""
        defaults = dict(
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            seed=0,
            step=0,
        )
        dtypes = dict(top_k=np.int32, seed=np.uint32, step=np.int32)
        cols = {
            k: np.array([r.get(k, d) if r.get(k) is not None else d for r in rows], dtype=dtypes.get(k, np.float32))
            for k, d in defaults.items()
        }
        return cls(**cols)


def pad_sampling(st: SamplingTensors, s: int) -> SamplingTensors:
    """Pads every per-row field to S rows with zeros (padding rows greedy). Once per step on the host: a copy into
    zeros, ~10x faster than np.pad (~100 us a call here, on every step's critical path before dispatch)."""

    def pad(a):
        a = np.asarray(a)
        out = np.zeros(s, a.dtype)
        out[: len(a)] = a
        return out

    return jax.tree.map(pad, st)


def apply_penalties(
    logits_bv: jax.Array, st: SamplingTensors, output_ids_bl: jax.Array | None, prompt_ids_bl: jax.Array | None
) -> jax.Array:
    """OpenAI presence/frequency penalties on generated tokens; HF/vLLM repetition penalty on prompt + output.

    Token id arrays are padded with -1.
    """
    b, v = logits_bv.shape

    def counts(ids):
        if ids is None:
            return jnp.zeros((b, v), jnp.float32)
        valid = ids >= 0
        return (
            jnp.zeros((b, v), jnp.float32)
            .at[jnp.arange(b)[:, None], jnp.where(valid, ids, 0)]
            .add(valid.astype(jnp.float32))
        )

    out_counts = counts(output_ids_bl)
    seen = (out_counts + counts(prompt_ids_bl)) > 0
    rep = st.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits_bv > 0, logits_bv / rep, logits_bv * rep), logits_bv)
    logits = logits - st.frequency_penalty[:, None] * out_counts
    return logits - st.presence_penalty[:, None] * (out_counts > 0)


# Sampling rows whose filters can be decided from the top TOP_CANDIDATES logits skip the full-vocabulary sort:
# top-k with k <= TOP_CANDIDATES (then top-p and min-p inside those), or top-p alone when the candidates already
# hold the mass p (the cutoff token is among them). Any other row makes its batch take the full sort.
TOP_CANDIDATES = 256


def _filter(logits_bv: jax.Array, st: SamplingTensors, candidates: int | None) -> tuple[jax.Array, jax.Array]:
    """(filtered logits [B, V], exact [B] bool): the filters of `filter_logits` decided from the top `candidates`
    logits of each row (all V when None); `exact` says where that equals the full-vocabulary decision."""
    temp = jnp.where(st.temperature > 0, st.temperature, 1.0)[:, None]
    logits = logits_bv / temp
    v = logits.shape[-1]
    c = v if candidates is None else min(candidates, v)
    sorted_desc = -jnp.sort(-logits, axis=-1) if c == v else jax.lax.top_k(logits, c)[0]  # [B, C] descending
    k = jnp.where((st.top_k > 0) & (st.top_k < v), st.top_k, v)
    in_candidates = k <= c  # the top-k set lies among the candidates (always, with all V)
    kth = jnp.take_along_axis(sorted_desc, jnp.minimum(k, c)[:, None] - 1, axis=-1)
    kth = jnp.where(in_candidates[:, None], kth, NEG_INF)  # top-k off (k = V > C): no bound from it
    # top-p acts on the distribution left by top-k, renormalised (the HF warper order and vLLM's top_k_top_p): over
    # the top k candidates, or over the whole vocabulary when top-k is off.
    in_top_k = jnp.arange(c)[None, :] < k[:, None]
    lse = jnp.where(
        in_candidates,
        jax.nn.logsumexp(jnp.where(in_top_k, sorted_desc, NEG_INF), axis=-1),
        jax.nn.logsumexp(logits, axis=-1),
    )
    probs_sorted = jnp.where(in_top_k, jnp.exp(sorted_desc - lse[:, None]), 0.0)
    # top-p: keep the smallest prefix whose mass reaches p (the token crossing p is kept); p = 1 keeps all, even
    # where the float32 cumsum reaches 1 early.
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_all = st.top_p >= 1.0
    keep_sorted = (mass_before < st.top_p[:, None]) | keep_all[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    pth = jnp.where(keep_all[:, None], NEG_INF, pth)
    threshold = jnp.maximum(kth, pth)
    # min-p: drop tokens whose probability is below min_p times the top probability.
    min_logit = sorted_desc[:, :1] + jnp.log(jnp.maximum(st.min_p[:, None], 1e-30))
    threshold = jnp.where(st.min_p[:, None] > 0, jnp.maximum(threshold, min_logit), threshold)
    exact = in_candidates | ((k >= v) & (keep_all | (n_keep < c)))
    return jnp.where(logits >= threshold, logits, NEG_INF), exact


def filter_logits(logits_bv: jax.Array, st: SamplingTensors) -> jax.Array:
    """Temperature-scaled logits with top-k, top-p and min-p applied (removed entries -> -inf)."""
    return _filter(logits_bv, st, None)[0]


def filter_logits_fast(logits_bv: jax.Array, st: SamplingTensors) -> jax.Array:
    """`filter_logits`, from the top TOP_CANDIDATES logits when that decides every sampling row (temperature > 0)
    exactly, else with the full-vocabulary sort (one lax.cond: the sort runs only for batches that need it)."""
    fast, exact = _filter(logits_bv, st, TOP_CANDIDATES)
    ok = jnp.all(exact | (st.temperature <= 0))
    return jax.lax.cond(ok, lambda: fast, lambda: filter_logits(logits_bv, st))


def unpack_bitmask(bitmask_bw: jax.Array, v: int) -> jax.Array:
    """Boolean [B, V] from a packed int32 bitmask [B, ceil(V/32)]: token t is bit t % 32 of word t // 32."""
    bits = jnp.right_shift(bitmask_bw[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(bitmask_bw.shape[0], -1)[:, :v] > 0


def sample(
    logits_bv: jax.Array,
    st: SamplingTensors,
    output_ids_bl: jax.Array | None = None,
    prompt_ids_bl: jax.Array | None = None,
    banned_ids_bn: jax.Array | None = None,
    *,
    num_logprobs: int = 0,
    allowed_bitmask_bw: jax.Array | None = None,
):
    """Samples one token per row.

    Args:
      logits_bv: float32 logits [B, V].
      st: per-row parameters.
      output_ids_bl / prompt_ids_bl: -1-padded token ids for penalties (None: no penalties).
      banned_ids_bn: -1-padded ids a row may not produce this step (EOS and stop ids before min_tokens).
      num_logprobs: static; also return the top-n logprobs of the model's raw distribution.
      allowed_bitmask_bw: optional packed int32 [B, ceil(V/32)] of the tokens each row may produce (a grammar's
        mask; unconstrained rows all ones); the others get -inf before any filtering. A row must allow some token.

    Returns:
      (tokens [B] int32, logprob of each chosen token [B], top ids [B, n], top logprobs [B, n]).
    """
    logits_bv = logits_bv.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits_bv, axis=-1)
    logits = logits_bv
    if output_ids_bl is not None or prompt_ids_bl is not None:
        logits = apply_penalties(logits, st, output_ids_bl, prompt_ids_bl)
    if banned_ids_bn is not None:
        rows = jnp.arange(logits.shape[0])[:, None]
        banned = (
            jnp.zeros(logits.shape, bool)
            .at[rows, jnp.where(banned_ids_bn >= 0, banned_ids_bn, 0)]
            .max(banned_ids_bn >= 0)
        )
        logits = jnp.where(banned, NEG_INF, logits)
    if allowed_bitmask_bw is not None:
        logits = jnp.where(unpack_bitmask(allowed_bitmask_bw, logits.shape[-1]), logits, NEG_INF)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        filtered = filter_logits_fast(logits, st)
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(st.seed, st.step)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        return jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)

    # An all-greedy batch skips the vocabulary sort and the Gumbel noise (a large share of a decode step at
    # batch 1 with a 128k vocabulary).
    sampled_tok = jax.lax.cond(jnp.any(st.temperature > 0), draw, lambda _: greedy_tok, None)
    tokens = jnp.where(st.temperature > 0, sampled_tok, greedy_tok)
    chosen_lp = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_logprobs, num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, chosen_lp, top_ids.astype(jnp.int32), top_lp
