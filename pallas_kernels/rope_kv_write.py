"""RoPE and the paged KV write in one kernel: the fused q|k|v projection's output goes in, rotated q comes out,
and rotated K and V land in their page slots.

Data flow (Triton / interpret backends):

    qkv [T, (Hq + 2 Hkv) * hd]   positions [T], slots [T] int32, inv_freq [hd / 2] float32
    grid (cdiv(T, bt), Hq + 2 Hkv): program (i, j) takes tokens i*bt .. i*bt + bt - 1 of head column j:
        j < Hq              rotate            -> q [T, Hq * hd]
        j < Hq + Hkv        rotate            -> k_pages[j - Hq, slot]           (int8: codes, scale -> k_scales)
        otherwise           as it is          -> v_pages[j - Hq - Hkv, slot]     (int8: codes, scale -> v_scales)
    The pages [Hkv, P, ps, hd] are viewed as [Hkv, P * ps, hd] (scales [Hkv, P * ps]) and updated in place
    (aliased): only the T slots are written, nothing else of the pool is read or written.

What it replaces, in every layer of every step: the slices of q|k|v, the two RoPE fusions and the two scatters
(four with int8 scales), each its own launch, which in a batch-1 decode step are latency, not bandwidth.

RoPE is rotate-half (HF / NeoX): with c = cos(p * inv_freq), s = sin(p * inv_freq) over the two halves x1, x2,
    out = [x1 c - x2 s, x2 c + x1 s]
in float32, rounded to qkv's dtype as the unfused model rounds it, then to the page dtype. int8 pages take one
scale per token per head, max|x| / 127 (never below 1e-12), and codes round-half-even(clip(x / scale)), as
model/kv.py's quantize_kv does (fp8 K is stored in a Hadamard basis there, so fp8 pages stay unfused).

A tile past T repeats the last token: it writes the same values to the same places, so no mask is needed.
The engine's padding tokens all write to slot 0 of the null page, which no sequence reads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.act_quant import _div, _round_half_even
from pallas_kernels.backend import out_struct, resolve_backend

INT8_MAX = 127.0
MIN_SCALE = 1e-12  # model/kv.py's floor: an all-zero head gets codes 0 and a finite scale
PAGE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int8))


@dataclasses.dataclass(frozen=True)
class RopeKVConfig:
    """Tokens per program and warps (a static argument).

    Attributes:
        block_tokens: tokens one program takes (a static loop); None: 1 up to 64 tokens (decode: one program per
            token and head, all in flight at once), else 8 (prefill: fewer, longer programs).
        num_warps: Triton warps per program.
    """

    block_tokens: int | None = None
    num_warps: int = 1

    def __post_init__(self):
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ValueError(f"RopeKVConfig.block_tokens must be >= 1 or None, got {self.block_tokens}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"RopeKVConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")

    def tokens(self, t: int) -> int:
        if self.block_tokens is not None:
            return self.block_tokens
        return 1 if t <= 64 else 8


def kernel_supports(page_dtype, head_dim: int) -> bool:
    """Whether the kernel (not only the reference) takes pages of this dtype and head size: bf16 / f16 / f32 / int8,
    and hd / 2 a power of two (Triton vectors)."""
    half = head_dim // 2
    return jnp.dtype(page_dtype) in PAGE_DTYPES and head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


# Layer 1: the kernel -----------------------------------------------------------------------------------------------


def _rotate(x1, x2, pos, inv_freq):
    """Rotate-half RoPE of one head's halves x1, x2 [hd / 2] (float32) at integer position `pos`."""
    angles = pos.astype(jnp.float32) * inv_freq
    c, s = jnp.cos(angles), jnp.sin(angles)
    return x1 * c - x2 * s, x2 * c + x1 * s


def _quantise(x1, x2, exact_div: bool):
    """int8 codes of one head's halves and its scale [1]: max|x| / 127 floored at 1e-12, round-half-even."""
    amax = jnp.maximum(jnp.max(jnp.abs(x1)), jnp.max(jnp.abs(x2)))
    scale = jnp.maximum(_div(amax[None], jnp.full((1,), INT8_MAX, jnp.float32), exact_div), MIN_SCALE)  # [1]

    def codes(x):
        return _round_half_even(jnp.clip(_div(x, jnp.broadcast_to(scale, x.shape), exact_div), -127.0, 127.0))

    return codes(x1).astype(jnp.int8), codes(x2).astype(jnp.int8), scale


def _kernel(pos_ref, slot_ref, inv_ref, qkv_ref, *refs, hq, hkv, t, bt, quantised, exact_div):
    # pos_ref, slot_ref [T] int32; inv_ref [hd/2] f32; qkv_ref [T, (hq + 2 hkv) * hd]
    # outputs: q_ref [T, hq * hd]; kp_ref, vp_ref [hkv, P * ps, hd] (aliased); int8: ks_ref, vs_ref [hkv, P * ps]
    n_in = 4 if quantised else 2  # the aliased pool inputs, never read here
    q_ref, kp_ref, vp_ref, *scale_refs = refs[n_in:]
    half = inv_ref.shape[0]
    hd = 2 * half
    i, j = pl.program_id(0), pl.program_id(1)
    inv_freq = inv_ref[...]

    def halves(tok):
        x1 = qkv_ref[tok, pl.ds(j * hd, half)].astype(jnp.float32)
        x2 = qkv_ref[tok, pl.ds(j * hd + half, half)].astype(jnp.float32)
        return x1, x2

    def rounded(x):  # the unfused model rounds RoPE's output to qkv's dtype before the write
        return x.astype(qkv_ref.dtype).astype(jnp.float32)

    def to_pages(pages_ref, s_ref, head, tok, x1, x2):
        slot = slot_ref[tok]
        if quantised:
            c1, c2, scale = _quantise(x1, x2, exact_div)
            s_ref[head, pl.ds(slot, 1)] = scale
        else:
            c1, c2 = x1.astype(pages_ref.dtype), x2.astype(pages_ref.dtype)
        pages_ref[head, slot, pl.ds(0, half)] = c1
        pages_ref[head, slot, pl.ds(half, half)] = c2

    ks_ref, vs_ref = scale_refs if quantised else (None, None)

    def one_token(tok):
        @pl.when(j < hq)
        def _():
            y1, y2 = _rotate(*halves(tok), pos_ref[tok], inv_freq)
            q_ref[tok, pl.ds(j * hd, half)] = y1.astype(q_ref.dtype)
            q_ref[tok, pl.ds(j * hd + half, half)] = y2.astype(q_ref.dtype)

        @pl.when((j >= hq) & (j < hq + hkv))
        def _():
            y1, y2 = _rotate(*halves(tok), pos_ref[tok], inv_freq)
            to_pages(kp_ref, ks_ref, j - hq, tok, rounded(y1), rounded(y2))

        @pl.when(j >= hq + hkv)
        def _():
            to_pages(vp_ref, vs_ref, j - hq - hkv, tok, *halves(tok))

    for r in range(bt):
        one_token(jnp.minimum(i * bt + r, t - 1))


# Layer 2: the pallas_call ------------------------------------------------------------------------------------------


def _pallas(qkv, positions, slots, inv_freq, pools, *, hq, config, interpret):
    """pools: (k_pages, v_pages) viewed [Hkv, P * ps, hd], plus (k_scales, v_scales) [Hkv, P * ps] for int8."""
    t = qkv.shape[0]
    hkv, hd = pools[0].shape[0], pools[0].shape[-1]
    bt = config.tokens(t)
    quantised = len(pools) == 4
    kernel = functools.partial(_kernel, hq=hq, hkv=hkv, t=t, bt=bt, quantised=quantised, exact_div=not interpret)
    inputs = (qkv, *pools)
    out_shape = (out_struct((t, hq * hd), qkv.dtype, inputs), *(out_struct(p.shape, p.dtype, inputs) for p in pools))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(t, bt), hq + 2 * hkv),
        input_output_aliases={4 + n: 1 + n for n in range(len(pools))},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name=f"rope_kv_write_bt{bt}" + ("_int8" if quantised else ""),
    )(positions, slots, inv_freq, qkv, *pools)


# Layer 3: the public entry point -----------------------------------------------------------------------------------


def _validate(qkv, positions, slots, inv_freq, k_pages, v_pages, k_scales, v_scales, hq, kernel: bool):
    if qkv.ndim != 2:
        raise ValueError(f"qkv must be [T, (Hq + 2 Hkv) * hd], got shape {qkv.shape}")
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"k_pages and v_pages must be equal [Hkv, P, ps, hd], got {k_pages.shape}, {v_pages.shape}")
    hkv, _, _, hd = k_pages.shape
    t = qkv.shape[0]
    if qkv.shape[1] != (hq + 2 * hkv) * hd:
        raise ValueError(f"qkv width {qkv.shape[1]} != (Hq {hq} + 2 Hkv {hkv}) * hd {hd}")
    if positions.shape != (t,) or slots.shape != (t,):
        raise ValueError(f"positions and slots must be [T={t}], got {positions.shape}, {slots.shape}")
    if not (jnp.issubdtype(positions.dtype, jnp.integer) and jnp.issubdtype(slots.dtype, jnp.integer)):
        raise ValueError(f"positions and slots must be integers, got {positions.dtype}, {slots.dtype}")
    if hd % 2 or inv_freq.shape != (hd // 2,):
        raise ValueError(f"inv_freq must be [hd / 2 = {hd // 2}] with hd even, got {inv_freq.shape}, hd {hd}")
    if jnp.dtype(k_pages.dtype) not in PAGE_DTYPES:
        raise ValueError(f"page dtype {k_pages.dtype} not supported; expected one of {PAGE_DTYPES}")
    quantised = jnp.dtype(k_pages.dtype) == jnp.int8
    if quantised != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError("int8 pages need k_scales and v_scales, and only int8 pages take them")
    if quantised and (k_scales.shape != k_pages.shape[:3] or v_scales.shape != k_pages.shape[:3]):
        raise ValueError(f"scales must be [Hkv, P, ps] = {k_pages.shape[:3]}, got {k_scales.shape}, {v_scales.shape}")
    if kernel and not kernel_supports(k_pages.dtype, hd):
        raise ValueError(f"the kernel needs hd / 2 a power of two (Triton vectors), got hd {hd}")


def rope_kv_write(
    qkv: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    inv_freq: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    num_q_heads: int,
    config: RopeKVConfig | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, ...]:
    """RoPE on q and k of a fused projection, and K / V written to their page slots.

    Args:
        qkv: [T, (Hq + 2 Hkv) * hd], the columns q | k | v (model/fused.py's unsharded layout).
        positions: [T] int, each token's position (its RoPE angle).
        slots: [T] int, each token's flat slot page * page_size + offset; all in range.
        inv_freq: [hd / 2] float32 RoPE inverse frequencies (model/layers.py rope_inv_freq).
        k_pages, v_pages: [Hkv, P, ps, hd] bf16 / f16 / f32 / int8; updated in place inside a jit that donates
            them (the engine's step); an eager call leaves the caller's arrays as they were (XLA copies them).
        k_scales, v_scales: [Hkv, P, ps] float32, with int8 pages only.
        num_q_heads: Hq.
        config: tiling; None: RopeKVConfig().
        backend: None (this device's choice), "triton", "interpret" or "xla" (the reference).

    Returns:
        (q [T, Hq, hd] in qkv's dtype, k_pages, v_pages) and, for int8 pages, k_scales, v_scales after them.
    """
    resolved = resolve_backend(backend, "rope_kv_write")
    if resolved == "mosaic_gpu":
        resolved = "triton"
    _validate(qkv, positions, slots, inv_freq, k_pages, v_pages, k_scales, v_scales, num_q_heads, resolved != "xla")
    args = (qkv, positions.astype(jnp.int32), slots.astype(jnp.int32), inv_freq.astype(jnp.float32))
    scales = () if k_scales is None else (k_scales, v_scales)
    if resolved == "xla":
        return reference(*args, k_pages, v_pages, *scales, num_q_heads=num_q_heads)
    return _kernel_jit(
        *args,
        k_pages,
        v_pages,
        *scales,
        hq=num_q_heads,
        config=config or RopeKVConfig(),
        interpret=resolved == "interpret",
    )


@functools.partial(jax.jit, static_argnames=("hq", "config", "interpret"))
def _kernel_jit(
    qkv, positions, slots, inv_freq, k_pages, v_pages, k_scales=None, v_scales=None, *, hq, config, interpret
):
    hkv, p, ps, hd = k_pages.shape
    pools = [k_pages.reshape(hkv, p * ps, hd), v_pages.reshape(hkv, p * ps, hd)]
    if k_scales is not None:
        pools += [k_scales.reshape(hkv, p * ps), v_scales.reshape(hkv, p * ps)]
    q, *out = _pallas(qkv, positions, slots, inv_freq, pools, hq=hq, config=config, interpret=interpret)
    shapes = (k_pages.shape, k_pages.shape, k_pages.shape[:3], k_pages.shape[:3])
    return (q.reshape(-1, hq, hd), *(o.reshape(s) for o, s in zip(out, shapes)))


# Layer 4: the reference --------------------------------------------------------------------------------------------


def reference(qkv, positions, slots, inv_freq, k_pages, v_pages, k_scales=None, v_scales=None, *, num_q_heads):
    """Plain jnp, the unfused model's steps: slice q | k | v, RoPE on q and k (rounded to qkv's dtype), quantise
    (int8 pages) and scatter into the slots."""
    hkv, p, ps, hd = k_pages.shape
    t = qkv.shape[0]
    x = qkv.reshape(t, num_q_heads + 2 * hkv, hd)
    q, k, v = x[:, :num_q_heads], x[:, num_q_heads : num_q_heads + hkv], x[:, num_q_heads + hkv :]
    angles = positions.astype(jnp.float32)[:, None, None] * inv_freq  # [T, 1, hd/2]
    c, s = jnp.cos(angles), jnp.sin(angles)

    def rope(h):
        x1, x2 = jnp.split(h.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(h.dtype)

    q, k = rope(q), rope(k)

    def scatter(pages, new_thd):
        flat = pages.reshape(hkv, p * ps, *pages.shape[3:])
        return flat.at[:, slots].set(jnp.swapaxes(new_thd, 0, 1).astype(pages.dtype)).reshape(pages.shape)

    if k_scales is None:
        return q, scatter(k_pages, k), scatter(v_pages, v)
    (kc, ks), (vc, vs) = _quantise_ref(k), _quantise_ref(v)
    return q, scatter(k_pages, kc), scatter(v_pages, vc), scatter(k_scales, ks), scatter(v_scales, vs)


def _quantise_ref(x_thd):
    x = x_thd.astype(jnp.float32)
    scales = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / INT8_MAX, MIN_SCALE)
    return jnp.clip(jnp.round(x / scales[..., None]), -127, 127).astype(jnp.int8), scales
