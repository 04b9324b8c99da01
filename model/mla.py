"""Multi-head latent attention (DeepSeek-V2/V3) with its compressed KV cache (Flax NNX).

    x [B, T, D] --w_a--> q part | c_kv' [R] | k_rope' [Dr]         (one matmul for both low-rank inputs)
        q part --(q_lora: RMSNorm, w_q_b)--> q [B, T, H, dn + dr] = q_nope [dn] | q_rope' [dr]
        c_kv = RMSNorm(c_kv');  q_rope, k_rope = YaRN RoPE(q_rope', k_rope')   (k_rope shared by all heads)
    cache row per token: [c_kv | k_rope]  (R + Dr wide, one "KV head": 576 values for DeepSeek-V3, not 2 H hd)
    absorbed attention (every path):
        q_latent [B, T, H, R] = q_nope @ W_UK^T         (W_UK, W_UV: the per-head halves of w_kv_b [R, H, dn | dv])
        o_latent [B, T, H, R] = softmax(q_latent . c_kv + q_rope . k_rope) @ c_kv      (over the cached rows)
        out [B, T, D]        = (o_latent @ W_UV) @ w_o

The absorbed form is exact: q_nope . (W_UK c) = (W_UK^T q_nope) . c, and softmax(..) @ (c W_UV) = (softmax(..) @ c)
W_UV. It lets every path read only the latent rows: the paged engine (model/kv.py PagedMeta) runs the Pallas MLA
kernels (pallas_kernels/mla_paged_attention.py for all-decode steps, mla_ragged_attention.py otherwise) over a
latent pool [1, num_pages, page_size, R + Dr] per layer (the layout of one KV head's pages in model/kv.py, so the
engine copies, places and sizes its blocks as any pool's: serving/engine/kv_pool.py); scoring (NoCache) and the contiguous path (ContiguousMeta,
latent cache [B, S_max, R + Dr]) use `latent_attention`, the same formula in plain jnp.

RoPE: DeepSeek-V3 checkpoints store the rope dims as interleaved pairs (rope_interleave); HF rotates them as
rotate-half after de-interleaving, so q and k (and the cached k_rope) here are de-interleaved the same way.
YaRN (rope_scaling type "yarn") changes the inverse frequencies, scales cos/sin by its attention factor, and
multiplies the softmax scale by mscale(factor, mscale_all_dim)^2, as transformers' DeepseekV3 does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.kv import ContiguousMeta, NoCache, PagedMeta
from model.layers import RMSNorm, apply_rope, yarn_inv_freq
from model.quant import matmul


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (HF rope_scaling with rope_type "yarn"); None fields take HF's defaults."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not self.factor > 0 or self.original_max_position_embeddings < 1:
            raise ValueError(f"yarn: factor and original_max_position_embeddings must be positive, got {self}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Shape and numerics of one MLA layer.

    Attributes:
        hidden_size: model width D.
        num_heads: query heads H.
        q_lora_rank: width of the compressed query (q_a_proj), or None for a full q_proj (DeepSeek-V2-Lite).
        kv_lora_rank: width R of the cached latent c_kv.
        qk_nope_head_dim: per-head query/key width dn without RoPE.
        qk_rope_head_dim: width Dr of the rotary part, shared by all heads on the key side.
        v_head_dim: per-head value width dv.
        rms_norm_eps: epsilon of the q and kv latent RMSNorms.
        rope_theta: RoPE base.
        rope_interleave: the checkpoint's rope dims are interleaved pairs (DeepSeek-V3 in transformers).
        yarn: YaRN scaling, or None for plain RoPE.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    yarn: YarnScaling | None = None

    def __post_init__(self):
        dims = (self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim)
        if min(dims) < 1 or (self.q_lora_rank is not None and self.q_lora_rank < 1):
            raise ValueError(f"MLA dimensions must be positive: {self}")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and >= 2, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Width of one cached row, R + Dr."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def q_a_width(self) -> int:
        """Query columns of the fused first projection: q_lora_rank, or H * (dn + dr) without a q LoRA."""
        return self.q_lora_rank if self.q_lora_rank is not None else self.num_heads * self.qk_head_dim

    @property
    def sm_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale

    def rope(self) -> tuple[jax.Array, float]:
        """(inverse frequencies [Dr / 2] float32, factor on cos / sin), as transformers computes them."""
        return yarn_rope(self.qk_rope_head_dim, self.rope_theta, self.yarn)


def yarn_rope(dim: int, base: float, y: YarnScaling | None) -> tuple[jax.Array, float]:
    """(inverse frequencies [dim / 2] float32, factor on cos / sin) of RoPE over `dim` dims with base `base`
    under YaRN scaling `y` (None: plain RoPE), as transformers computes them (DeepSeek here, gpt-oss through
    model/layers.py rope_inv_freq, which holds the frequency ramp: yarn_inv_freq)."""
    pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    inv = 1.0 / pos_freqs
    if y is None:
        return inv, 1.0
    if y.attention_factor is not None:
        attention_factor = y.attention_factor
    elif y.mscale and y.mscale_all_dim:
        attention_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(y.factor)

    inv = yarn_inv_freq(
        inv, dim, base, y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow, y.truncate
    )
    return inv, float(attention_factor)


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., d] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...]: interleaved RoPE as rotate-half."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def rotate(x_bthd, positions_bt, inv_freq, factor: float, interleaved: bool):
    """YaRN / plain RoPE of [B, T, H, Dr] in float32: rotate-half with cos and sin scaled by `factor`."""
    x = deinterleave(x_bthd) if interleaved else x_bthd
    out = apply_rope(x.astype(jnp.float32), positions_bt, inv_freq)
    return out * factor if factor != 1.0 else out


def latent_attention(q_lat, q_rope, latent, mask, sm_scale):
    """Absorbed attention in plain jnp, float32.

    Args:
        q_lat: [B, T, H, R]; q_rope: [B, T, H, Dr]; latent: [B, S, R + Dr] rows [c_kv | k_rope].
        mask: [B, T, S] bool, True where the query may see the row.
        sm_scale: logit scale.

    Returns:
        [B, T, H, R] float32 attention-weighted latents (zero for rows that see nothing).
    """
    hi = jax.lax.Precision.HIGHEST
    rank = q_lat.shape[-1]
    latent = latent.astype(jnp.float32)
    c, k_rope = latent[..., :rank], latent[..., rank:]
    s = jnp.einsum("bthr,bsr->bhts", q_lat.astype(jnp.float32), c, precision=hi)
    s = (s + jnp.einsum("bthd,bsd->bhts", q_rope.astype(jnp.float32), k_rope, precision=hi)) * sm_scale
    s = jnp.where(mask[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("bhts,bsr->bthr", p, c, precision=hi)


def write_latent(pages: jax.Array, rows_tc: jax.Array, slots_t: jax.Array) -> jax.Array:
    """Scatters new latent rows [T, R + Dr] into pages [P, ps, R + Dr] at flat slots [T]."""
    p, ps, width = pages.shape
    flat = pages.reshape(p * ps, width).at[slots_t].set(rows_tc.astype(pages.dtype))
    # As model/kv.py write_pages: keeps XLA from fusing the scatter into the reader (a whole-pool copy on CPU).
    return jax.lax.optimization_barrier(flat.reshape(p, ps, width))


def init_mla_paged_cache(num_layers: int, num_pages: int, page_size: int, cfg: MlaConfig, dtype) -> list[tuple]:
    """Zeroed latent pools, one (pages [1, P, ps, R + Dr],) per layer (float dtypes only): one "KV head" of
    R + Dr values per token, which every query head reads."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"MLA latent cache: dtype must be bf16/f16/f32, got {jnp.dtype(dtype).name}")
    return [(jnp.zeros((1, num_pages, page_size, cfg.latent_width), dtype),) for _ in range(num_layers)]


def mla_bytes_per_token(cfg: MlaConfig, dtype) -> int:
    """Bytes one token takes in one layer's latent pool."""
    return cfg.latent_width * jnp.dtype(dtype).itemsize


def _absorb(spec: str, x, w):
    """The per-head W_UK / W_UV products in float32: full-precision products for float32 weights, the weights'
    16-bit dtype on the tensor cores (float32 accumulation) otherwise."""
    if w.dtype == jnp.float32:
        return jnp.einsum(spec, x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _param(shape, dtype, rngs: nnx.Rngs | None) -> nnx.Param:
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(shape[0] ** -0.5 * jax.random.normal(rngs.params(), shape, dtype))


class MlaAttention(nnx.Module):
    """MLA: low-rank q / kv projections, latent RMSNorms, decoupled YaRN RoPE, absorbed attention, w_o.

    Parameters ([in, out] like every projection here): w_a [D, q_a_width + R + Dr] (q_a_proj | kv_a_proj_with_mqa,
    or q_proj | kv_a_proj_with_mqa without a q LoRA), q_a_norm [q_lora] and w_q_b [q_lora, H (dn + dr)] with a q
    LoRA, kv_a_norm [R], w_kv_b [R, H (dn + dv)] (kv_b_proj), w_o [H dv, D].
    """

    def __init__(self, cfg: MlaConfig, dtype, rngs: nnx.Rngs | None):
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_heads
        self.w_a = _param((d, cfg.q_a_width + cfg.latent_width), dtype, rngs)
        if cfg.q_lora_rank is not None:
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.w_q_b = _param((cfg.q_lora_rank, h * cfg.qk_head_dim), dtype, rngs)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.w_kv_b = _param((cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)), dtype, rngs)
        self.w_o = _param((h * cfg.v_head_dim, d), dtype, rngs)

    def project(self, x_btd, positions_bt):
        """(q_latent [B, T, H, R] f32, q_rope [B, T, H, Dr] f32, new latent rows [B, T, R + Dr] f32)."""
        cfg = self.cfg
        b, t, _ = x_btd.shape
        a = matmul(x_btd, self.w_a.get_value())  # [B, T, q_a_width + R + Dr]
        q, c_kv, k_rope = jnp.split(a, [cfg.q_a_width, cfg.q_a_width + cfg.kv_lora_rank], axis=-1)
        if cfg.q_lora_rank is not None:
            q = matmul(self.q_a_norm(q), self.w_q_b.get_value())
        q = q.reshape(b, t, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        inv_freq, factor = cfg.rope()
        q_rope = rotate(q_rope, positions_bt, inv_freq, factor, cfg.rope_interleave)  # [B, T, H, Dr]
        k_rope = rotate(k_rope[:, :, None], positions_bt, inv_freq, factor, cfg.rope_interleave)[:, :, 0]
        c_kv = self.kv_a_norm(c_kv).astype(jnp.float32)  # [B, T, R]
        w_uk = self._kv_b()[..., : cfg.qk_nope_head_dim]  # [R, H, dn]
        q_lat = _absorb("bthn,rhn->bthr", q_nope, w_uk)
        return q_lat, q_rope, jnp.concatenate([c_kv, k_rope], axis=-1)

    def _kv_b(self):
        cfg = self.cfg
        w = self.w_kv_b.get_value()
        return w.reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)

    def output(self, o_lat_bthr, dtype):
        """[B, T, H, R] attention-weighted latents -> [B, T, D]: W_UV per head, then w_o."""
        cfg = self.cfg
        w_uv = self._kv_b()[..., cfg.qk_nope_head_dim :]  # [R, H, dv]
        o = _absorb("bthr,rhv->bthv", o_lat_bthr, w_uv)
        b, t = o.shape[:2]
        return matmul(o.reshape(b, t, -1).astype(dtype), self.w_o.get_value())

    def __call__(self, x_btd, positions_bt, cache, meta):
        """(out [B, T, D], new cache). `meta` is model/kv.py's NoCache, ContiguousMeta or PagedMeta; the cache is
        None, a latent array [B, S_max, R + Dr] or the paged (pages [1, P, ps, R + Dr],) tuple respectively."""
        q_lat, q_rope, rows = self.project(x_btd, positions_bt)
        scale = self.cfg.sm_scale
        if isinstance(meta, PagedMeta):
            o, cache = paged_latent_attention(meta, q_lat, q_rope, rows, cache, scale)
        elif isinstance(meta, ContiguousMeta):
            cache = jax.vmap(lambda c, new, s: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), s, 0))(
                cache, rows, positions_bt[:, 0]
            )
            mask = jnp.arange(cache.shape[1])[None, None, :] <= positions_bt[:, :, None]
            o = latent_attention(q_lat, q_rope, cache, mask, scale)
        elif isinstance(meta, NoCache):
            idx = jnp.arange(x_btd.shape[1])
            mask = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] < meta.valid_len[:, None, None])
            o = latent_attention(q_lat, q_rope, rows, mask, scale)
        else:
            raise ValueError(f"MLA attention: unsupported attention metadata {type(meta).__name__}")
        return self.output(o, x_btd.dtype), cache


def paged_latent_attention(meta: PagedMeta, q_lat, q_rope, rows, cache, sm_scale):
    """Writes the new rows into the latent pool and runs the MLA kernel of this step: the decode kernel when
    every sequence has one query token, else the ragged one. q_lat [1, T, H, R], rows [1, T, R + Dr].

    Tensor parallelism (`meta.mesh` with a tensor axis > 1 dividing H): the pool is replicated (every head reads
    every row, and each device computes the same rows), so the write runs everywhere; the kernel runs inside
    `jax.shard_map` on the query heads a device owns, and the heads' outputs stay split for W_UV and w_o
    (model/deepseek.py place_on_mesh splits w_q_b, w_kv_b and w_o by heads)."""
    (pool,) = cache  # [1, P, ps, R + Dr]
    pages = write_latent(pool[0], rows[0], meta.slot_mapping)
    q_lat, q_rope = q_lat[0].astype(pages.dtype), q_rope[0].astype(pages.dtype)  # the kernels' compute dtype
    tp = 1 if meta.mesh is None else meta.mesh.shape.get("tensor", 1)
    if tp > 1 and q_lat.shape[1] % tp:
        raise ValueError(f"MLA attention: tensor_parallel_size={tp} does not divide the {q_lat.shape[1]} heads")
    args = (meta.block_tables, meta.kv_lens, meta.cu_q_lens, meta.num_seqs)
    if tp == 1:
        o = _latent_kernel(meta, sm_scale, q_lat, q_rope, pages, *args)
    else:
        from jax.sharding import PartitionSpec as P

        heads, rep = P(None, "tensor", None), P()
        o = jax.shard_map(
            functools.partial(_latent_kernel, meta, sm_scale),
            mesh=meta.mesh,
            in_specs=(heads, heads, rep, rep, rep, rep, rep),
            out_specs=heads,
            check_vma=False,
        )(q_lat, q_rope, pages, *args)
    return o[None], (pages[None],)


def _latent_kernel(meta: PagedMeta, sm_scale, q_lat, q_rope, pages, block_tables, kv_lens, cu_q_lens, num_seqs):
    """[T, H, R] attention-weighted latents from the pool pages [P, ps, R + Dr] (after this step's writes)."""
    from pallas_kernels.mla_paged_attention import mla_paged_attention
    from pallas_kernels.mla_ragged_attention import mla_ragged_attention

    kw = dict(sm_scale=sm_scale, backend=meta.backend)
    if meta.decode_only:
        return mla_paged_attention(q_lat, q_rope, pages, block_tables, kv_lens, **kw)
    return mla_ragged_attention(q_lat, q_rope, pages, block_tables, kv_lens, cu_q_lens, num_seqs, **kw)
