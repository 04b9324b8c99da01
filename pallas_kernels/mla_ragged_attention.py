"""MLA ragged paged attention: one launch over a mixed batch of prefill chunks and decode rows.

The absorbed form of pallas_kernels/mla_paged_attention.py (read its docstring for the latent layout) over
a flat, ragged batch of query tokens, with the tiling of pallas_kernels/ragged_paged_attention.py:

    q_latent [T, H, R], q_rope [T, H, Dr] --> [Hb, T_pad * bh, R] / [.., Dr]   (Hb = head blocks of bh heads)
        row r of head block j = (token r // bh, query head j * bh + r % bh)
    metadata pass (XLA, on device): `ragged_paged_attention.tile_metadata`'s work list of query tiles;
        sequences with more than `small` query tokens get prefill tiles of bq tokens, the others
        (decode, speculative verify) one small tile each.
    grid (Hb, W): program (j, w) takes the rows of tile w for head block j and walks the sequence's pages
        up to the tile's last causal position; each latent page is gathered once for all rows
        (tokens x heads) and serves as both key (with its rope part) and value; causal mask per row;
        masked store of the rows that belong to the sequence.
    o [Hb, T_pad * bh, R] --> [T, H, R], rows at or past cu_q_lens[num_seqs] zeroed.

Query j of sequence s sits at position kv_lens[s] - q_len[s] + j and sees latent rows 0..that position.
Absorbed prefill spends R + Dr (576 for DeepSeek) multiply-adds per logit instead of the 192 of
decompressed keys; it reads only the latent pool, which is what lets prefill chunks and decode rows share
one launch over the cache the engine keeps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import out_struct, resolve_backend
from pallas_kernels.mla_paged_attention import (
    check_block,
    check_pallas_dims,
    heads_per_program,
    init_carry,
    latent_scores,
    latent_step,
    load_latent_block,
    pad_heads,
    validate_latent,
)
from pallas_kernels.paged_attention import LOG2E, check_triton_params
from pallas_kernels.paged_common import validate_ragged_rows
from pallas_kernels.ragged_paged_attention import PREFILL_TILE, SCHEDULES, SMALL_TILE, tile_metadata


@dataclasses.dataclass(frozen=True)
class MlaRaggedConfig:
    """Tile sizes for the MLA ragged kernel (a static argument). Not yet tuned on a GPU: the defaults
    follow the Triton MLA decode kernel vLLM and SGLang ship (16 heads and 32 latent rows a step, 2 stages).

    Attributes:
        block_heads: query heads per program (power of 2 >= 16; fewer heads are padded up to 16).
        block_q_rows: query rows (tokens x heads of the program) per prefill tile.
        small_q_rows: query rows per small tile (decode and verify rows); 0 disables small tiles.
        block_tokens: latent rows per inner-loop step; a step gathers max(1, block_tokens // page_size) pages.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the page loop.
        schedule: order of the work list, "interleave" or "prefill_first" (see `tile_metadata`).
    """

    block_heads: int = 16
    block_q_rows: int = 64
    small_q_rows: int = 16
    block_tokens: int = 32
    num_warps: int = 4
    num_stages: int = 2
    schedule: str = "prefill_first"

    def __post_init__(self):
        check_block("block_heads", self.block_heads)
        check_block("block_q_rows", self.block_q_rows)
        if self.small_q_rows:
            check_block("small_q_rows", self.small_q_rows)
        check_block("block_tokens", self.block_tokens)
        check_triton_params(self.num_warps, self.num_stages)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    def tokens_per_tile(self, heads: int) -> tuple[int, int]:
        """(tokens per prefill tile, tokens per small tile; 0 when small tiles are off) for `heads` per row."""
        big = max(1, self.block_q_rows // heads)
        small = max(1, self.small_q_rows // heads) if self.small_q_rows else 0
        return big, (small if small < big else 0)


# ---------------------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------------------
def _attend_tile(
    seq,
    q0,
    cu_q_lens_ref,
    kv_lens_ref,
    block_tables_ref,
    q_lat_ref,
    q_rope_ref,
    pages_ref,
    o_ref,
    *,
    block_q,
    heads,
    scale_log2,
    page_size,
    pages_per_block,
):
    """Causal attention of tokens q0 .. q0+block_q-1 of sequence `seq` (rows past its end are not stored)."""
    q_begin, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    first_pos = kv_lens_ref[seq] - (q_end - q_begin)  # position of the sequence's first query token
    rows = block_q * heads
    tok = q0 + jnp.arange(rows) // heads  # [M] flat token of each row
    pos = first_pos + tok - q_begin  # [M] causal position of each row
    kv_hi = first_pos + jnp.minimum(q0 + block_q, q_end) - q_begin  # keys the tile's last row sees
    block_tokens = pages_per_block * page_size
    q_lat = q_lat_ref[pl.ds(q0 * heads, rows), :]  # [M, R]
    q_rope = q_rope_ref[pl.ds(q0 * heads, rows), :]  # [M, Dr]
    rank = q_lat.shape[1]

    def body(i, carry):
        page0 = i * pages_per_block
        pages = block_tables_ref[seq, pl.ds(page0, pages_per_block)]  # [pages_per_block]
        first_token = page0 * page_size
        c, k_rope, valid = load_latent_block(pages_ref, pages, first_token, kv_hi, page_size, rank)
        key = first_token + jnp.arange(block_tokens)  # [N]
        mask = valid[None, :] & (key[None, :] <= pos[:, None])  # [M, N]
        return latent_step(q_lat, q_rope, c, k_rope, mask, carry, scale_log2=scale_log2)

    acc, _, l = jax.lax.fori_loop(0, pl.cdiv(kv_hi, block_tokens), body, init_carry(rows, rank))
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    store_mask = jnp.broadcast_to((tok < q_end)[:, None], out.shape)
    pltriton.store(o_ref.at[pl.ds(q0 * heads, rows), :], out, mask=store_mask)


def _ragged_kernel(
    tiles_ref,  # [3, W] int32: kind, sequence, first flat token of each entry
    cu_q_lens_ref,  # [S+1] int32
    kv_lens_ref,  # [S] int32
    block_tables_ref,  # [S, max_blocks_padded] int32
    q_lat_ref,  # [T_pad * bh, R] page dtype, head block j
    q_rope_ref,  # [T_pad * bh, Dr] page dtype, head block j
    pages_ref,  # [num_pages * page_size, R + Dr] the whole latent pool
    o_ref,  # [T_pad * bh, R] q dtype, head block j
    *,
    block_q: int,
    small_block_q: int,
    **static,
):
    w = pl.program_id(1)
    kind, seq, q0 = tiles_ref[0, w], tiles_ref[1, w], tiles_ref[2, w]
    refs = (cu_q_lens_ref, kv_lens_ref, block_tables_ref, q_lat_ref, q_rope_ref, pages_ref, o_ref)
    pl.when(kind == PREFILL_TILE)(lambda: _attend_tile(seq, q0, *refs, block_q=block_q, **static))
    if small_block_q:  # one branch per tile size: a decode row does not pay for a prefill-sized tile
        pl.when(kind == SMALL_TILE)(lambda: _attend_tile(seq, q0, *refs, block_q=small_block_q, **static))


# ---------------------------------------------------------------------------------------------------------
# pallas_call builder.
# ---------------------------------------------------------------------------------------------------------
def _to_rows(x, padded_tokens, padded_heads, bh):
    """[T, H, X] -> [Hb, T_pad * bh, X]: row r of head block j is (token r // bh, head j * bh + r % bh)."""
    num_tokens, _, width = x.shape
    x = pad_heads(jnp.pad(x, ((0, padded_tokens - num_tokens), (0, 0), (0, 0))), padded_heads)
    return (
        x.reshape(padded_tokens, padded_heads // bh, bh, width)
        .transpose(1, 0, 2, 3)
        .reshape(-1, padded_tokens * bh, width)
    )


def _ragged_pallas(q_latent, q_rope, pages, block_tables, kv_lens, cu_q_lens, num_seqs, *, sm_scale, config, interpret):
    num_tokens, num_heads, rank = q_latent.shape
    num_pages, page_size, width = pages.shape
    bh = heads_per_program(config.block_heads, num_heads)
    padded_heads = -(-num_heads // bh) * bh
    block_q, small_block_q = config.tokens_per_tile(bh)
    num_slots = kv_lens.shape[0]
    max_tiles = num_tokens // block_q + num_slots  # prefill tiles <= T / bq + S_prefill, small <= S_small
    padded_tokens = num_tokens + block_q  # a tile may start near T and span bq tokens
    pages_per_block = max(1, config.block_tokens // page_size)
    pad_pages = -block_tables.shape[1] % pages_per_block  # both are powers of 2
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad_pages)))  # padding is never read unmasked
    q_lat = _to_rows(q_latent.astype(pages.dtype), padded_tokens, padded_heads, bh)
    q_rp = _to_rows(q_rope.astype(pages.dtype), padded_tokens, padded_heads, bh)
    tiles = tile_metadata(
        cu_q_lens, num_seqs, block_q=block_q, small_block_q=small_block_q, max_tiles=max_tiles, schedule=config.schedule
    )
    kernel = functools.partial(
        _ragged_kernel,
        block_q=block_q,
        small_block_q=small_block_q,
        heads=bh,
        scale_log2=sm_scale * LOG2E,
        page_size=page_size,
        pages_per_block=pages_per_block,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda j, w: (0,) * len(shape))  # noqa: E731
    rows_spec = lambda x: pl.BlockSpec((None,) + x.shape[1:], lambda j, w: (j, 0, 0))  # noqa: E731
    slots = num_pages * page_size
    out_shape = out_struct(q_lat.shape, q_latent.dtype, (q_lat, pages, block_tables, kv_lens))
    o_rows = pl.pallas_call(
        kernel,
        grid=(padded_heads // bh, max_tiles),
        in_specs=[
            whole((3, max_tiles)),
            whole(cu_q_lens.shape),
            whole(kv_lens.shape),
            whole(block_tables.shape),
            rows_spec(q_lat),
            rows_spec(q_rp),
            whole((slots, width)),
        ],
        out_specs=rows_spec(q_lat),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"mla_ragged_ps{page_size}_h{bh}_q{block_q}_bt{config.block_tokens}_{config.schedule}",
    )(tiles, cu_q_lens, kv_lens, block_tables, q_lat, q_rp, pages.reshape(slots, width))

    o = o_rows.reshape(padded_heads // bh, padded_tokens, bh, rank).transpose(1, 0, 2, 3)
    o = o.reshape(padded_tokens, padded_heads, rank)[:num_tokens, :num_heads]
    live = jnp.arange(num_tokens) < cu_q_lens[num_seqs]  # rows no tile wrote hold garbage
    return jnp.where(live[:, None, None], o, jnp.zeros((), o.dtype))


# ---------------------------------------------------------------------------------------------------------
# Validation, public entry point and reference.
# ---------------------------------------------------------------------------------------------------------
def _validate(q_latent, q_rope, pages, block_tables, kv_lens, cu_q_lens, num_seqs, sm_scale):
    name = "mla_ragged_attention"
    validate_latent(name, q_latent, q_rope, pages, sm_scale)
    validate_ragged_rows(name, block_tables, kv_lens, cu_q_lens, num_seqs)


@functools.partial(jax.jit, static_argnames=("sm_scale", "backend", "config"))
def mla_ragged_attention(
    q_latent,
    q_rope,
    latent_pages,
    block_tables,
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    backend=None,
    config: MlaRaggedConfig = MlaRaggedConfig(),
):
    """Causal absorbed MLA attention of a flat, ragged batch of query tokens over a paged latent cache.

    Args:
        q_latent: [T, H, R] absorbed queries of all sequences, back to back.
        q_rope: [T, H, Dr] rotary part of the queries.
        latent_pages: [num_pages, page_size, R + Dr] rows [c_kv | k_rope] (bf16/f16/f32).
        block_tables: [S, max_blocks] int32 page ids of each sequence slot.
        kv_lens: [S] int32 KV length of each sequence including this step's tokens (already in the pages).
        cu_q_lens: [S+1] int32 cumulative query lengths; sequence s owns tokens cu_q_lens[s]:cu_q_lens[s+1].
        num_seqs: int32 scalar; slots at or past it are padding.
        sm_scale: logit scale (DeepSeek: mscale^2 / sqrt(qk_nope_dim + qk_rope_dim)); required.
        backend: None, "triton", "interpret" or "xla" (see pallas_kernels.backend).
        config: tile sizes (static).

    Returns:
        [T, H, R] in q_latent's dtype; rows at or past cu_q_lens[num_seqs] are zero.
    """
    _validate(q_latent, q_rope, latent_pages, block_tables, kv_lens, cu_q_lens, num_seqs, sm_scale)
    num_seqs = jnp.reshape(num_seqs, ())
    sm_scale = float(sm_scale)
    args = (q_latent, q_rope, latent_pages, block_tables, kv_lens, cu_q_lens, num_seqs)
    resolved = resolve_backend(backend, "mla_ragged_attention")
    if resolved == "xla":
        return reference(*args, sm_scale=sm_scale).astype(q_latent.dtype)
    if resolved == "mosaic_gpu":
        raise ValueError("mla_ragged_attention: no mosaic_gpu kernel yet; use backend='triton'")
    check_pallas_dims("mla_ragged_attention", q_latent.shape[-1], q_rope.shape[-1])
    return _ragged_pallas(*args, sm_scale=sm_scale, config=config, interpret=resolved == "interpret")


def reference(
    q_latent,
    q_rope,
    latent_pages,
    block_tables,
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    backend=None,
    token_chunk=64,
):
    """Plain-jnp float32 ragged MLA; gathers each token's page list, `token_chunk` tokens at a time."""
    del backend
    num_tokens, num_heads, rank = q_latent.shape
    num_seqs = jnp.reshape(num_seqs, ())
    pool = latent_pages.astype(jnp.float32)
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, block_tables.shape[0] - 1)  # [T]
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (t - cu_q_lens[seq])  # [T]
    live = t < cu_q_lens[num_seqs]

    def one_chunk(args):
        q_lat, q_rp, seq_c, pos_c = args  # [C, H, R], [C, H, Dr], [C], [C]
        rows = pool[block_tables[seq_c]].reshape(len(seq_c), -1, pool.shape[-1])  # [C, L, R + Dr]
        valid = jnp.arange(rows.shape[1])[None, :] <= pos_c[:, None]  # [C, L]
        rows = jnp.where(valid[..., None], rows, 0.0)  # unused slots may hold NaN
        logits = latent_scores(q_lat, q_rp, rows[..., :rank], rows[..., rank:]) * sm_scale  # [C, H, L]
        p = jax.nn.softmax(jnp.where(valid[:, None, :], logits, -jnp.inf), axis=-1)
        return jnp.einsum("chl,clr->chr", p, rows[..., :rank], precision=jax.lax.Precision.HIGHEST)

    chunk = min(token_chunk, num_tokens)
    pad = -num_tokens % chunk
    split = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, chunk, *x.shape[1:])  # noqa: E731
    o = jax.lax.map(one_chunk, (split(q_latent), split(q_rope), split(seq), split(jnp.maximum(pos, 0))))
    o = o.reshape(-1, num_heads, rank)[:num_tokens]
    return jnp.where(live[:, None, None], o, 0.0)
