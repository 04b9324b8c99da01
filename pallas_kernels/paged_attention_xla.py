"""Paged attention in plain XLA whose work follows the keys actually attended, not the block-table width.

The "xla" backend of `ragged_paged_attention` and `paged_attention` (the CPU host's serving path). The kernels'
`reference()` functions gather every query token's whole table row, [Hkv, tokens, width * page_size, D], so a
step with a 256-token chunk at width 512 (8,192 positions) gathers about 3 GB per layer however few keys are
live. Here the work is a list of query tiles, and each tile walks only its own sequence's pages up to its last
causal position (from its first row's window start with a sliding window), with an online softmax:

    q [T, Hq, D]        flat query tokens of every sequence, back to back
    tile list [N]       (sequence, first token, rows) per tile of `q_tile` tokens of one sequence;
                        N = min(T, ceil(T / q_tile) + S) bounds the count statically; extra tiles have no rows
    tile n              q rows [Hkv, q_tile * G, D]; for kv block b in [lo // kv_tile, ceil(hi / kv_tile)):
                          gather the sequence's pages of block b -> K, V [Hkv, kv_tile, D] (dequantised there)
                          scores [Hkv, q_tile * G, kv_tile]; running max / sum / output, float32
    o [T, Hq, D]        each token read from its tile's rows; rows at or past cu_q_lens[num_seqs] are zero

`hi` is the tile's last query position + 1 and `lo` the first key of its first row's window (0 without one), so
a step's cost is proportional to the query rows times the context they attend, and the table width only sizes
the int32 table. Attention sinks (gpt-oss) join each row's running sum after the loop. Same contract and float32
accumulation as the references, up to the order of summation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_common import softcap_scores

Q_TILE = 64  # query tokens per tile: prefill chunks fill them; a decode row is one tile of one row
KV_TILE = 512  # keys gathered per loop step (rounded to whole pages)


def _gather_block(pages, scales, page_ids):
    """pages [Hkv, P, ps, D] at page_ids [n] -> float32 [Hkv, n * ps, D] (times the scales of quantised pages)."""
    x = pages[:, page_ids].astype(jnp.float32)
    if scales is not None:
        x = x * scales[:, page_ids][..., None]
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _tile_list(cu_q_lens, num_seqs, num_tiles: int, q_tile: int):
    """Per tile (sequence, first flat token, rows), and per sequence the index of its first tile."""
    num_slots = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(num_slots) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    n_tiles = (q_lens + q_tile - 1) // q_tile
    tile_end = jnp.cumsum(n_tiles)  # [S]
    first_tile = tile_end - n_tiles
    i = jnp.arange(num_tiles)
    seq = jnp.clip(jnp.searchsorted(tile_end, i, side="right"), 0, num_slots - 1)  # [N]
    start = cu_q_lens[seq] + (i - first_tile[seq]) * q_tile
    rows = jnp.where(i < tile_end[-1], jnp.clip(cu_q_lens[seq + 1] - start, 0, q_tile), 0)
    return seq, start, rows, first_tile


@functools.partial(jax.jit, static_argnames=("sm_scale", "window", "logit_softcap", "q_tile", "kv_tile"))
def ragged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    k_scales=None,
    v_scales=None,
    window: int | None = None,
    logit_softcap: float | None = None,
    sinks=None,
    q_tile: int = Q_TILE,
    kv_tile: int = KV_TILE,
):
    """Causal attention of a flat, ragged batch over a paged KV cache (`ragged_paged_attention`'s contract).

    Args:
      q: [T, Hq, D] query tokens; sequence s owns tokens cu_q_lens[s]:cu_q_lens[s + 1].
      k_pages, v_pages: [Hkv, P, ps, D] pages (float, or int8 / fp8 with [Hkv, P, ps] k_scales / v_scales).
      block_tables: [S, W] int32 page ids; kv_lens: [S] int32 (this step's keys included).
      cu_q_lens: [S + 1] int32; num_seqs: int32 scalar (slots at or past it are padding).
      sm_scale: logit scale; window, logit_softcap: as in `ragged_paged_attention`.
      sinks: [Hq] float attention-sink logits (gpt-oss: one more key per head with a zero value), or None.
      q_tile, kv_tile: query tokens per tile and keys per loop step (static; the work does not depend on them
        beyond padding).

    Returns:
      [T, Hq, D] float32; rows at or past cu_q_lens[num_seqs] are zero.
    """
    num_tokens, q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = q_heads // num_kv_heads
    num_seqs = jnp.reshape(num_seqs, ())
    q_tile = max(1, min(q_tile, num_tokens))
    pages_per_step = max(1, kv_tile // page_size)
    keys_per_step = pages_per_step * page_size
    width = block_tables.shape[1]
    tables = jnp.pad(block_tables, ((0, 0), (0, -width % pages_per_step)))  # whole steps; the extra keys are masked
    num_tiles = min(num_tokens, -(-num_tokens // q_tile) + block_tables.shape[0])
    seq, start, rows, first_tile = _tile_list(cu_q_lens, num_seqs, num_tiles, q_tile)
    q_pad = jnp.pad(q.astype(jnp.float32), ((0, q_tile), (0, 0), (0, 0)))  # a tile's slice never clamps

    def one_tile(args):
        s, t0, n = args
        q_t = jax.lax.dynamic_slice_in_dim(q_pad, t0, q_tile)  # [C, Hq, D]
        q_t = q_t.reshape(q_tile, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
        q_t = q_t.reshape(num_kv_heads, q_tile * group, head_dim)  # row r = (token r // G, head h * G + r % G)
        first = kv_lens[s] - (cu_q_lens[s + 1] - cu_q_lens[s]) + (t0 - cu_q_lens[s])  # position of row 0
        pos = first + jnp.arange(q_tile)  # [C]
        live_row = jnp.arange(q_tile) < n
        hi = jnp.where(n > 0, first + n, 0)  # keys [lo, hi) cover every live row
        lo = jnp.int32(0) if window is None else jnp.maximum(first - window + 1, 0)
        table = tables[s]

        def body(carry):
            b, m, l, acc = carry
            ids = jax.lax.dynamic_slice_in_dim(table, b * pages_per_step, pages_per_step)
            key = b * keys_per_step + jnp.arange(keys_per_step)  # [K]
            in_range = ((key >= lo) & (key < hi))[None, :, None]
            k = jnp.where(in_range, _gather_block(k_pages, k_scales, ids), 0.0)  # slots past kv_len may hold NaN
            v = jnp.where(in_range, _gather_block(v_pages, v_scales, ids), 0.0)
            ok = live_row[:, None] & (key[None, :] <= pos[:, None])  # [C, K]
            if window is not None:
                ok &= key[None, :] > pos[:, None] - window
            ok = jnp.repeat(ok, group, axis=0)[None]  # [1, C * G, K]
            s_ = jnp.einsum("hrd,hkd->hrk", q_t, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
            s_ = jnp.where(ok, softcap_scores(s_, logit_softcap), -jnp.inf)
            m_new = jnp.maximum(m, s_.max(axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s_ - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)  # 0 while m is -inf
            acc = acc * alpha[..., None] + jnp.einsum("hrk,hkd->hrd", p, v, precision=jax.lax.Precision.HIGHEST)
            return b + 1, m_new, l * alpha + p.sum(axis=-1), acc

        shape = (num_kv_heads, q_tile * group)
        init = (lo // keys_per_step, jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
        steps = (hi + keys_per_step - 1) // keys_per_step
        _, m, l, acc = jax.lax.while_loop(lambda c: c[0] < steps, body, init)
        if sinks is not None:  # row r's head is h * G + r % G
            sink = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, q_tile))  # [Hkv, C * G]
            m_new = jnp.maximum(m, sink)
            alpha = jnp.exp(m - m_new)
            acc, l = acc * alpha[..., None], l * alpha + jnp.exp(sink - m_new)
        o = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # [Hkv, C * G, D]
        return o.reshape(num_kv_heads, q_tile, group, head_dim).transpose(1, 0, 2, 3).reshape(q_tile, q_heads, -1)

    o_tiles = jax.lax.map(one_tile, (seq, start, rows))  # [N, C, Hq, D]
    t = jnp.arange(num_tokens)
    tok_seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, block_tables.shape[0] - 1)
    offset = t - cu_q_lens[tok_seq]
    tile = jnp.clip(first_tile[tok_seq] + offset // q_tile, 0, num_tiles - 1)
    o = o_tiles[tile, offset % q_tile]  # [T, Hq, D]
    live = t < cu_q_lens[num_seqs]
    return jnp.where(live[:, None, None], o, 0.0)


def decode_attention(q, k_pages, v_pages, block_tables, lengths, **kwargs):
    """`paged_attention`'s contract (one query per sequence at position lengths - 1; length 0 gives zeros)
    through `ragged_attention` with one-row tiles."""
    batch = q.shape[0]
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    return ragged_attention(q, k_pages, v_pages, block_tables, lengths, cu, jnp.int32(batch), q_tile=1, **kwargs)
