"""KV-cache layouts and the attention metadata that tells a layer how to write and read them.

The transformer is written once; what changes between scoring a sequence, the contiguous reference generation
path and the paged engine is only how each layer stores the new K/V and which keys a query may see. Each of
those is a small pytree dataclass with one method,

    attend(q [B,T,Hq,hd], k [B,T,Hkv,hd], v [B,T,Hkv,hd], positions [B,T], cache, *, window, sm_scale)
        -> (out [B,T,Hq,hd], cache)

so the metadata travels through `jax.jit` as an ordinary argument. `window` is the layer's sliding window (a
query at position p sees keys in (p - window, p]; None: all of 0..p) and `sm_scale` its logit scale (None:
1/sqrt(hd)); both are static per layer, as is the optional `logit_softcap` (Gemma 2: scaled scores s become
cap * tanh(s / cap) before the softmax). `sinks` [Hq] (gpt-oss), when given, adds one learned logit per query
head to every softmax denominator (pallas_kernels/paged_common.py); it is an array, so it is traced.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30


def masked_attention(
    q_bthd: jax.Array,
    k_bshd: jax.Array,
    v_bshd: jax.Array,
    mask_bts: jax.Array,
    sm_scale: float | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Plain GQA attention with an explicit boolean mask (True = may attend); float32 softmax, with the
    attention-sink logits `sinks` [Hq] in each denominator when given.

    Rows whose mask is all False return zeros.
    """
    b, t, hq, hd = q_bthd.shape
    hkv = k_bshd.shape[2]
    scale = hd**-0.5 if sm_scale is None else sm_scale
    q = q_bthd.reshape(b, t, hkv, hq // hkv, hd)
    s = (
        jnp.einsum(
            "btkgd,bskd->bkgts",
            q,
            k_bshd.astype(q.dtype),
            preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST,
        )
        * scale
    )
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    s = jnp.where(mask_bts[:, None, None], s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:  # [Hq] -> [Hkv, G, 1, 1], against s [B, Hkv, G, T, S]
        sink = sinks.astype(jnp.float32).reshape(hkv, hq // hkv, 1, 1)
        m = jnp.maximum(m, sink)
    p = jnp.where(mask_bts[:, None, None], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v_bshd.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, t, hq, hd).astype(q_bthd.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NoCache:
    """Causal self-attention over the input alone (scoring / teacher forcing). `valid_len` [B] masks padding."""

    valid_len: jax.Array  # [B]

    def attend(self, q, k, v, positions, cache: Any, *, window=None, sm_scale=None, logit_softcap=None, sinks=None):
        t = q.shape[1]
        idx = jnp.arange(t)
        mask = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] < self.valid_len[:, None, None])
        if window is not None:
            mask &= idx[None, None, :] > idx[None, :, None] - window
        return masked_attention(q, k, v, mask, sm_scale, logit_softcap, sinks), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ContiguousMeta:
    """Contiguous per-layer cache (k, v) each [B, S_max, Hkv, hd].

    The T new tokens of row b are written at positions[b, 0] .. positions[b, 0] + T - 1; a query at position p
    sees keys 0..p. Right-padded prompts are fine: padding writes junk past a row's length, and that junk is
    overwritten by the row's real decode tokens before any query can see it.
    """

    def attend(self, q, k, v, positions, cache, *, window=None, sm_scale=None, logit_softcap=None, sinks=None):
        k_cache, v_cache = cache
        start = positions[:, 0]
        write = jax.vmap(lambda c, new, s: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), s, axis=0))
        k_cache = write(k_cache, k, start)
        v_cache = write(v_cache, v, start)
        keys = jnp.arange(k_cache.shape[1])
        mask = keys[None, None, :] <= positions[:, :, None]
        if window is not None:
            mask &= keys[None, None, :] > positions[:, :, None] - window
        return masked_attention(q, k_cache, v_cache, mask, sm_scale, logit_softcap, sinks), (k_cache, v_cache)


def init_contiguous_cache(
    num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed contiguous caches, one (k, v) pair per layer, each [B, S_max, Hkv, hd]."""
    shape = (batch, max_len, num_kv_heads, head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedMeta:
    """Paged KV cache (the engine): per layer (k_pages, v_pages), each [Hkv, num_pages, page_size, hd].

    The batch is flat: tokens [1, T] of several sequences back to back. Token t's K/V goes to slot
    `slot_mapping[t]` (= page * page_size + offset); then attention runs either the ragged kernel (mixed prefill
    chunks and decode rows; causal inside each chunk) or, when every sequence has exactly one query token and
    T == num sequence slots, the paged decode kernel.

    Tensor parallelism (`mesh` with a tensor axis > 1): the KV write and the kernel run inside `jax.shard_map`,
    each device on its own query heads and KV-head pages, with no communication. With fewer KV heads than devices
    the pool holds each KV head repeated tp / Hkv times (sharding/rules.py `kv_cache_heads`), so every device
    still owns exactly the one KV head its query heads read; new K/V are repeated the same way before the write.
    """

    slot_mapping: jax.Array  # [T] int32
    block_tables: jax.Array  # [S, max_blocks] int32
    kv_lens: jax.Array  # [S] int32, including this step's tokens
    cu_q_lens: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # [] int32
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    backend: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))  # jax.sharding.Mesh or None
    # RoPE + KV write as one kernel where `fuses_rope` allows; False: the unfused XLA ops (A/B comparisons)
    fuse_rope: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def attend(self, q, k, v, positions, cache, *, window=None, sm_scale=None, logit_softcap=None, sinks=None):
        # cache: (k_pages, v_pages) float pages, or (k_pages, v_pages, k_scales, v_scales) quantised pages.
        k_pages = cache[0]
        attn = dict(window=window, sm_scale=sm_scale, logit_softcap=logit_softcap)
        repeat = k_pages.shape[0] // k.shape[2]  # > 1: KV heads repeated to the tensor-parallel degree
        if repeat > 1:
            k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        # A Mesh, or the AbstractMesh of a pipeline stage (model/pipeline.py): both give their axis sizes in .shape.
        tp = 1 if self.mesh is None else self.mesh.shape.get("tensor", 1)
        if tp == 1 or q.shape[2] % tp or k_pages.shape[0] % tp:
            out, *cache = self._write_attend(q[0], k[0], v[0], *cache, sinks=sinks, **attn)
            return out[None], tuple(cache)
        from jax.sharding import PartitionSpec as P

        heads, rep = P(None, "tensor", None), P()
        specs = tuple(P("tensor", *([None] * (a.ndim - 1))) for a in cache)  # pages 4-D, scales 3-D
        fn = jax.shard_map(  # sinks [Hq] split with the query heads
            lambda meta, sinks, *a: meta._write_attend(*a, sinks=sinks, **attn),
            mesh=self.mesh,
            in_specs=(rep, rep if sinks is None else P("tensor"), heads, heads, heads, *specs),
            out_specs=(heads, *specs),
            check_vma=False,
        )
        out, *cache = fn(self, sinks, q[0], k[0], v[0], *cache)
        return out[None], tuple(cache)

    def fuses_rope(self, cache: Any, num_kv_heads: int) -> bool:
        """Whether this step's RoPE and KV write run as one kernel (`rope_attend`): on a GPU (the kernel backends),
        for float or int8 pages (fp8 K is stored rotated: rotate_for_kv) of the model's own KV heads on
        one device, with hd / 2 a power of two, unless the `fuse_rope` option is off."""
        from pallas_kernels import rope_kv_write
        from pallas_kernels.backend import resolve_backend

        k_pages = cache[0]
        tp = 1 if self.mesh is None else self.mesh.shape.get("tensor", 1)
        return (
            self.fuse_rope
            and tp == 1
            and k_pages.shape[0] == num_kv_heads
            and rope_kv_write.kernel_supports(k_pages.dtype, k_pages.shape[-1])
            and resolve_backend(self.backend, "rope_kv_write") != "xla"
        )

    def rope_attend(self, qkv, positions, inv_freq, cache, *, num_q_heads, window=None, sm_scale=None, sinks=None):
        """`attend` for q | k | v still unrotated: qkv [1, T, (Hq + 2 Hkv) * hd] -> (out [1, T, Hq, hd], cache).
        One kernel rotates q and k and writes K / V (quantised for int8 pages) into their slots; then the same
        attention kernels as `attend`. Only where `fuses_rope` says so."""
        from pallas_kernels.rope_kv_write import rope_kv_write

        q, *cache = rope_kv_write(
            qkv[0], positions[0], self.slot_mapping, inv_freq, *cache, num_q_heads=num_q_heads, backend=self.backend
        )
        out = self._attend(q, *cache, window=window, sm_scale=sm_scale, sinks=sinks)
        return out[None], tuple(cache)

    def _write_attend(
        self,
        q,
        k,
        v,
        k_pages,
        v_pages,
        k_scales=None,
        v_scales=None,
        window=None,
        sm_scale=None,
        logit_softcap=None,
        sinks=None,
    ):
        """KV write then the kernel on one device's heads: q [T, Hq, hd], k/v [T, Hkv, hd] -> (out, *cache)."""
        quantised = k_scales is not None
        if quantised:
            q, k = rotate_for_kv(q, k, k_pages.dtype)  # fp8 K: both in the Hadamard basis (q.k unchanged)
            k, k_new_scales = quantize_kv(k, k_pages.dtype)
            v, v_new_scales = quantize_kv(v, v_pages.dtype)
            k_scales = write_scales(k_scales, k_new_scales, self.slot_mapping)
            v_scales = write_scales(v_scales, v_new_scales, self.slot_mapping)
        k_pages = write_pages(k_pages, k, self.slot_mapping)
        v_pages = write_pages(v_pages, v, self.slot_mapping)
        attn = dict(window=window, sm_scale=sm_scale, logit_softcap=logit_softcap, sinks=sinks)
        out = self._attend(q, k_pages, v_pages, k_scales, v_scales, **attn)
        return (out, k_pages, v_pages, k_scales, v_scales) if quantised else (out, k_pages, v_pages)

    def _attend(
        self,
        q,
        k_pages,
        v_pages,
        k_scales=None,
        v_scales=None,
        window=None,
        sm_scale=None,
        logit_softcap=None,
        sinks=None,
    ):
        """The attention kernel over pages already written: the paged decode kernel or the ragged one."""
        from pallas_kernels.paged_attention import paged_attention
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        attn_args = dict(
            window=window, sm_scale=sm_scale, logit_softcap=logit_softcap, k_scales=k_scales, v_scales=v_scales
        )
        if sinks is not None:  # (only then: kernels without the option keep their exact call)
            attn_args["sinks"] = sinks
        if self.decode_only:
            return paged_attention(
                q, k_pages, v_pages, self.block_tables, self.kv_lens, backend=self.backend, **attn_args
            )
        return ragged_paged_attention(
            q,
            k_pages,
            v_pages,
            self.block_tables,
            self.kv_lens,
            self.cu_q_lens,
            self.num_seqs,
            backend=self.backend,
            **attn_args,
        )


def write_pages(pages: jax.Array, new_thd: jax.Array, slots_t: jax.Array) -> jax.Array:
    """Scatters new [T, Hkv, hd] into pages [Hkv, P, ps, hd] at flat slots [T]."""
    h, p, ps, hd = pages.shape
    flat = pages.reshape(h, p * ps, hd)
    flat = flat.at[:, slots_t].set(jnp.swapaxes(new_thd, 0, 1).astype(pages.dtype))
    # The barrier keeps XLA from fusing this scatter into the attention that reads the pages: on the CPU that
    # fusion made the donated pool be copied whole for every layer of every step (a 1-token decode step went from
    # 0.2 ms to 960 ms of KV writes at 4,096 blocks; benchmarks/step_vs_pool.py). On the GPU it changes nothing.
    return jax.lax.optimization_barrier(flat.reshape(h, p, ps, hd))


KV_QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}  # largest code of each format
_MIN_KV_SCALE = 1e-12  # floor of a scale: an all-zero head gets codes 0 and a finite, non-zero scale


def is_quantized_kv(dtype) -> bool:
    return jnp.dtype(dtype) in KV_QUANT_MAX


def quantize_kv(new_thd: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """New K or V [T, Hkv, hd] -> (codes [T, Hkv, hd] of `dtype`, scales [T, Hkv] float32): one scale per token per
    head, absmax / 127 (int8) or absmax / 448 (fp8 e4m3), never zero; value = code * scale."""
    dtype = jnp.dtype(dtype)
    x = new_thd.astype(jnp.float32)
    scales = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / KV_QUANT_MAX[dtype], _MIN_KV_SCALE)
    y = x / scales[..., None]
    if dtype == jnp.int8:
        codes = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
    else:
        codes = jnp.clip(y, -448.0, 448.0).astype(dtype)
    return codes, scales


@functools.cache
def _hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix [n, n] (n a power of two), symmetric: H @ H = I."""
    h = np.ones((1, 1), np.float32)  # numpy: a constant, never a tracer held by the cache
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h * np.float32(n**-0.5)


def rotate_for_kv(q: jax.Array, k: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """q [..., hd], k [..., hd] -> both times the orthonormal Hadamard matrix H, when K is stored as fp8 e4m3 and
    hd is a power of two; else unchanged.

    Exact for attention: (q H) . (k H) = q H H^T k = q . k, so the pages hold H k and every later query of the
    layer comes through here rotated the same way (prefix-cached and copy-on-write pages too: H is fixed). Why:
    e4m3 keeps 3 mantissa bits, so its error is relative to each element, and K's few large channels (whose
    products with q's matching channels dominate q . k) carried most of it; H spreads every channel over all hd
    of them. SmolLM2 prose: KV fp8 perplexity +1.19% -> +0.43%, KL 0.0089 -> 0.0063 (BENCHMARKS.md). int8 (an
    absolute error of amax / 254) is left as it is, and V's error was ~10x smaller (no rotation).
    """
    hd = k.shape[-1]
    if jnp.dtype(dtype) != jnp.float8_e4m3fn or hd & (hd - 1):
        return q, k
    h = _hadamard(hd)

    def rot(x):
        return jnp.einsum("...d,de->...e", x, jnp.asarray(h, x.dtype), preferred_element_type=jnp.float32).astype(
            x.dtype
        )

    return rot(q), rot(k)


def write_scales(scales: jax.Array, new_th: jax.Array, slots_t: jax.Array) -> jax.Array:
    """Scatters new per-token scales [T, Hkv] into scales [Hkv, P, ps] at flat slots [T]."""
    h, p, ps = scales.shape
    flat = scales.reshape(h, p * ps).at[:, slots_t].set(jnp.swapaxes(new_th, 0, 1).astype(scales.dtype))
    return jax.lax.optimization_barrier(flat.reshape(h, p, ps))


def init_paged_cache(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype
) -> list[tuple[jax.Array, ...]]:
    """Zeroed pages per layer: (k_pages, v_pages) [Hkv, P, ps, hd]; for int8 / float8_e4m3fn pages also
    (k_scales, v_scales) [Hkv, P, ps] float32, initialised to 1 (a slot never written reads as 0, never 0 / 0)."""
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    if not is_quantized_kv(dtype):
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]
    ones = functools.partial(jnp.ones, shape[:3], jnp.float32)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), ones(), ones()) for _ in range(num_layers)]


def kv_bytes_per_token_head(head_dim: int, dtype) -> int:
    """Bytes of one token of one KV head in K or V: hd codes, plus a float32 scale for quantised pages."""
    return head_dim * jnp.dtype(dtype).itemsize + (4 if is_quantized_kv(dtype) else 0)
