"""Quantisation methods: float weights [K, N] (in, out) -> QuantizedArray (model/quant.py layouts), in JAX.

    rtn(w, fmt, ...)                      round to nearest, per output channel (int8 / fp8) or per group (int4)
    awq(w, x, ...)                        per-input-channel scales s = a^alpha searched on calibration inputs x;
                                          stores Q(diag(s) w) with pre_scale = 1 / s
    gptq(w, x, ...)                       input rows quantised one by one; each row's error is spread over the rows
                                          not yet quantised through the inverse Hessian (2 x^T x) of the inputs
    smoothquant(w, x, alpha)              W8A8 int8: s = max|x|^alpha / max|w|^(1-alpha) moves outliers from x
                                          into w; int8 weights per channel, int8 activations per token
    fp8_w8a8(w, x=None)                   W8A8 fp8: per-channel e4m3 weights; activations per token (dynamic) or
                                          with one static scale calibrated on x
    fp8_calibrated(w, x)                  W8A16 fp8 whose per-channel scales minimise the activation-weighted
                                          squared weight error (the scale search below)

Calibration inputs x are the activations that reach the layer [T, K] (float32). Scales are floored at a tiny
positive value, so an all-zero column or group never yields a zero or NaN scale.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from model.quant import ACT_MAX, QuantizedArray, codes_barrier

TINY = 1e-8
FP8_MAX = 448.0


# ---------------------------------------------------------------------------------------------------------
# Round to nearest.
# ---------------------------------------------------------------------------------------------------------
def pack_int4(codes_kn: jax.Array) -> jax.Array:
    """codes [K, N] in 0..15 -> uint8 [K/2, N]: row 2i in the low nibble, row 2i+1 in the high."""
    codes = codes_kn.astype(jnp.uint8)
    return codes[0::2] | (codes[1::2] << 4)


def unpack_int4(values: jax.Array) -> jax.Array:
    """uint8 [K/2, N] -> codes [K, N] (inverse of pack_int4)."""
    k2, n = values.shape
    return jnp.stack([values & 0xF, values >> 4], axis=1).reshape(2 * k2, n)


def _safe(scale: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(scale) & (scale > TINY), scale, jnp.where(jnp.isfinite(scale), TINY, 1.0))


ZERO_POINTS = ("int", "float")
CLIP_STEPS = 20  # shrink factors 1, 0.975, ..., 0.525 of a group's range tried by the clip search


def int4_group_params(w_kn: jax.Array, group_size: int, asymmetric: bool, zero_point: str = "int", shrink=1.0):
    """Scales (and zero points) [K/g, N] of each group of g input rows, for the group's range times `shrink`.

    zero_point (asymmetric): "int" puts 0 inside the range and rounds the zero point to an integer code (the
    GPTQ / AWQ kernels' convention); "float" uses [min, max] itself with zero = -min / scale, a real number (GGUF
    Q4_1's convention; our zeros are float32, so the format and kernels take it as is): all 16 codes cover the
    group's values, none is spent on reaching 0.
    """
    if zero_point not in ZERO_POINTS:
        raise ValueError(f"zero_point must be one of {ZERO_POINTS}, got {zero_point!r}")
    k, n = w_kn.shape
    wg = w_kn.reshape(k // group_size, group_size, n)
    if not asymmetric:
        return _safe(jnp.max(jnp.abs(wg), axis=1) * shrink / 7.0), None
    lo, hi = jnp.min(wg, axis=1) * shrink, jnp.max(wg, axis=1) * shrink
    if zero_point == "float":
        scale = _safe((hi - lo) / 15.0)
        return scale, -lo / scale
    lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)
    scale = _safe((hi - lo) / 15.0)
    return scale, jnp.clip(jnp.round(-lo / scale), 0, 15)


def int4_codes(w_kn, scales, zeros, group_size):
    """Codes [K, N] of w for given group scales / zero points (zero 8 when symmetric)."""
    s = jnp.repeat(scales, group_size, axis=0)
    z = 8.0 if zeros is None else jnp.repeat(zeros, group_size, axis=0)
    return jnp.clip(jnp.round(w_kn / s + z), 0, 15)  # = round(w / s) + z for an integer z


@functools.partial(jax.jit, static_argnames=("group_size", "asymmetric", "zero_point", "steps"))
def int4_clip_search(w_kn, x_tk, group_size: int, asymmetric: bool, zero_point: str = "int", steps=CLIP_STEPS):
    """Group scales / zeros whose range is shrunk by the factor (of `steps` in (0.5, 1]) that minimises each
    group's output error e^T H_g e per output channel, H_g = x_g^T x_g / T the group's block of the input Hessian
    (AWQ's clip search; GPTQ's `mse` grid with the inputs' weighting). Clipping a few large weights buys a finer
    step for all the others."""
    w = jnp.asarray(w_kn, jnp.float32)
    x = jnp.asarray(x_tk, jnp.float32)
    k, n = w.shape
    g = group_size
    wg = w.reshape(k // g, g, n)
    xg = x.reshape(x.shape[0], k // g, g)
    h_gij = jnp.einsum("tgi,tgj->gij", xg, xg, precision="highest") / x.shape[0]  # [K/g, g, g]

    def params(shrink):
        sc, z = int4_group_params(w, g, asymmetric, zero_point, shrink)
        return sc, (8.0 * jnp.ones_like(sc) if z is None else z)

    def error(sc, z):
        codes = int4_codes(w, sc, z, g).reshape(k // g, g, n)
        e = wg - (codes - z[:, None]) * sc[:, None]
        return jnp.einsum("gin,gij,gjn->gn", e, h_gij, e, precision="highest")

    def body(j, best):
        sc, z = params(1.0 - 0.5 * j / steps)
        err = error(sc, z)
        better = err < best[0]
        return tuple(jnp.where(better, new, old) for new, old in zip((err, sc, z), best))

    sc, z = params(1.0)
    _, sc, z = jax.lax.fori_loop(1, steps, body, (error(sc, z), sc, z))
    return sc, (z if asymmetric else None)


def _int4_array(w_kn, scales, zeros, group_size) -> QuantizedArray:
    values = pack_int4(int4_codes(w_kn, scales, zeros, group_size))
    return QuantizedArray(values, scales, zeros, fmt="int4", group_size=group_size)


def rtn(w_kn, fmt: str, *, group_size: int = 128, asymmetric: bool = False, per_tensor: bool = False, zero_point="int"):
    """Round-to-nearest QuantizedArray of w [K, N].

    Args:
        fmt: "int8" (per output channel, symmetric), "fp8" (e4m3, per channel or `per_tensor`), "int4"
            (per group of `group_size` input rows; symmetric, or `asymmetric` with `zero_point` "int" or
            "float": int4_group_params).
    """
    w = jnp.asarray(w_kn, jnp.float32)
    if fmt == "int8":
        scale = _safe(jnp.max(jnp.abs(w), axis=0) / 127.0)
        return QuantizedArray(jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale, fmt="int8")
    if fmt == "fp8":
        amax = jnp.max(jnp.abs(w)) if per_tensor else jnp.max(jnp.abs(w), axis=0)
        scale = _safe(amax / FP8_MAX)
        return QuantizedArray(jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale, fmt="fp8")
    if fmt != "int4":
        raise ValueError(f"rtn: unknown fmt {fmt!r}; choose int8, fp8 or int4")
    if w.shape[0] % group_size or group_size % 2:
        raise ValueError(f"rtn: K={w.shape[0]} is not a multiple of group_size={group_size}")
    scales, zeros = int4_group_params(w, group_size, asymmetric, zero_point)
    return _int4_array(w, scales, zeros, group_size)


# ---------------------------------------------------------------------------------------------------------
# fp8 scales chosen on calibration inputs.
# ---------------------------------------------------------------------------------------------------------
FP8_SCALE_STEPS = 32  # candidate scales per octave


def _fp8_roundtrip(w, scale):
    return codes_barrier(jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)).astype(jnp.float32) * scale


@functools.partial(jax.jit, static_argnames=("steps",))
def fp8_channel_scales(w_kn, x_tk, steps: int = FP8_SCALE_STEPS) -> jax.Array:
    """Per-output-channel e4m3 scales [N] minimising sum_k E[x_k^2] (w_kn - Q(w_kn))^2 (the diagonal of the
    output error's Hessian), over amax / 448 * 2^(-j / steps), j < steps.

    Why a search: e4m3 keeps 3 mantissa bits, so its error is relative and depends on where each value falls
    inside its binade; amax / 448 pins only the largest value and leaves the rest wherever the scale puts them.
    One octave of candidates covers every placement (a factor 2 moves every value by one exponent, same error)."""
    w = jnp.asarray(w_kn, jnp.float32)
    x = jnp.asarray(x_tk, jnp.float32)
    h_k = jnp.mean(x * x, axis=0)[:, None]  # [K, 1]
    amax = _safe(jnp.max(jnp.abs(w), axis=0) / FP8_MAX)  # [N]
    factors = 2.0 ** (-jnp.arange(steps, dtype=jnp.float32) / steps)

    def error(c):  # [N]
        return jnp.sum(h_k * (w - _fp8_roundtrip(w, amax * c)) ** 2, axis=0)

    best = jnp.argmin(jax.lax.map(error, factors), axis=0)
    return amax * factors[best]


def fp8_calibrated(w_kn, x_tk, *, steps: int = FP8_SCALE_STEPS) -> QuantizedArray:
    """W8A16 fp8 (e4m3 per output channel) with the scales of `fp8_channel_scales` (calibration inputs x)."""
    w = jnp.asarray(w_kn, jnp.float32)
    scale = fp8_channel_scales(w, x_tk, steps)
    return QuantizedArray(jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale, fmt="fp8")


# ---------------------------------------------------------------------------------------------------------
# AWQ.
# ---------------------------------------------------------------------------------------------------------
def awq(
    w_kn,
    x_tk,
    *,
    fmt: str = "int4",
    group_size: int = 128,
    asymmetric: bool = True,
    grid: int = 20,
    zero_point: str = "int",
    clip: bool = True,
    search_tokens: int | None = None,
    **kw,
):
    """Activation-aware weight quantisation: the per-input-channel scale s = mean|x|^alpha (alpha on a grid of
    `grid` points in [0, 1), alpha = 0 is RTN) that minimises ||x w - x w_q||^2 on the calibration inputs; then
    (int4, `clip`) each group's range is shrunk by int4_clip_search on the scaled weight and inputs.

    search_tokens: at most this many inputs (evenly strided) for the alpha search; the mean |x| and the clip
    search use all of x. Returns a QuantizedArray of diag(s) w with pre_scale = 1 / s (x -> x / s first).
    """
    w = jnp.asarray(w_kn, jnp.float32)
    x = jnp.asarray(x_tk, jnp.float32)
    xs = x if not search_tokens else x[:: max(1, x.shape[0] // search_tokens)]
    act = jnp.maximum(jnp.mean(jnp.abs(x), axis=0), TINY)  # [K]
    errors = [
        float(_awq_error(w, xs, act, jnp.float32(i / grid), fmt, group_size, asymmetric, zero_point))
        for i in range(grid)
    ]
    alpha = errors.index(min(errors)) / grid
    s = _awq_scale(act, alpha)
    if fmt == "int4" and clip:
        scales, zeros = int4_clip_search(w * s[:, None], x / s, group_size, asymmetric, zero_point)
        q = _int4_array(w * s[:, None], scales, zeros, group_size)
    else:
        q = rtn(w * s[:, None], fmt, group_size=group_size, asymmetric=asymmetric, zero_point=zero_point, **kw)
    return QuantizedArray(q.values, q.scales, q.zeros, q.fmt, q.group_size, pre_scale=1.0 / s)


def _awq_scale(act, alpha):
    s = act**alpha
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))  # keep the scaled weight's range near the original


@functools.partial(jax.jit, static_argnames=("fmt", "group_size", "asymmetric", "zero_point"))
def _awq_error(w, x, act, alpha, fmt, group_size, asymmetric, zero_point):
    s = _awq_scale(act, alpha)
    q = rtn(w * s[:, None], fmt, group_size=group_size, asymmetric=asymmetric, zero_point=zero_point)
    return jnp.sum((x @ w - (x / s) @ q.dequantize(jnp.float32)) ** 2)


# ---------------------------------------------------------------------------------------------------------
# GPTQ.
# ---------------------------------------------------------------------------------------------------------
def _inverse_hessian_cholesky(x_tk, damp: float) -> jax.Array:
    """Upper Cholesky factor U of H^-1 (H = 2 x^T x + damp * mean diag), H^-1 = U^T U."""
    h = 2.0 * x_tk.T @ x_tk
    k = h.shape[0]
    dead = jnp.diag(h) == 0  # inputs never seen: any value of their rows is as good
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(k)
    h_inv = jnp.linalg.inv(h)
    h_inv = (h_inv + h_inv.T) / 2
    return jnp.linalg.cholesky(h_inv).T


@functools.partial(jax.jit, static_argnames=("fmt", "group_size", "asymmetric", "zero_point"))
def _gptq_block(wb, ub, fixed_scales, *, fmt, group_size, asymmetric, zero_point="int"):
    """Quantises the rows of one block wb [B, N] in order, compensating inside the block only.

    Returns (codes [B, N], group scales [B/g, N], group zeros [B/g, N], scaled errors [B, N]); the caller applies
    the errors to the rows after the block in one matmul (the paper's lazy batch update).
    """
    rows, n = wb.shape
    g = group_size if fmt == "int4" else rows

    def body(i, carry):
        w_cur, codes, scales, zeros, errs = carry
        grp = i // g
        if fmt == "int4":  # a group's scale is fixed from its rows as they stand when the group begins
            rows_g = jax.lax.dynamic_slice_in_dim(w_cur, grp * g, g, axis=0)
            fresh_s, fresh_z = int4_group_params(rows_g, g, asymmetric, zero_point)
            start = i % g == 0
            scales = scales.at[grp].set(jnp.where(start, fresh_s[0], scales[grp]))
            if asymmetric:
                zeros = zeros.at[grp].set(jnp.where(start, fresh_z[0], zeros[grp]))
            s, zp = scales[grp], (zeros[grp] if asymmetric else 8.0)
            code = jnp.clip(jnp.round(w_cur[i] / s + zp), 0, 15)
            deq = (code - zp) * s
        elif fmt == "int8":
            code = jnp.clip(jnp.round(w_cur[i] / fixed_scales), -127, 127)
            deq = code * fixed_scales
        else:  # fp8: e4m3 rounding of the compensated row (the error is then relative, not uniform)
            code = jnp.clip(w_cur[i] / fixed_scales, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
            code = codes_barrier(code).astype(jnp.float32)  # XLA on a GPU would elide the e4m3 round trip
            deq = code * fixed_scales
        err = (w_cur[i] - deq) / ub[i, i]  # [N]
        later = (jnp.arange(rows) > i)[:, None]
        w_cur = w_cur - jnp.where(later, ub[i][:, None] * err[None, :], 0.0)
        return w_cur, codes.at[i].set(code), scales, zeros, errs.at[i].set(err)

    groups = max(1, rows // g)
    init = (wb, jnp.zeros_like(wb), jnp.ones((groups, n)), jnp.zeros((groups, n)), jnp.zeros_like(wb))
    _, codes, scales, zeros, errs = jax.lax.fori_loop(0, rows, body, init)
    return codes, scales, zeros, errs


@jax.jit
def _gptq_block_static(wb, ub, s_rows, z_rows):
    """int4 with scales fixed beforehand, per row: s_rows / z_rows [B, N] (act-order GPTQ with static groups)."""

    def body(i, carry):
        w_cur, codes, errs = carry
        code = jnp.clip(jnp.round(w_cur[i] / s_rows[i] + z_rows[i]), 0, 15)
        err = (w_cur[i] - (code - z_rows[i]) * s_rows[i]) / ub[i, i]
        later = (jnp.arange(wb.shape[0]) > i)[:, None]
        w_cur = w_cur - jnp.where(later, ub[i][:, None] * err[None, :], 0.0)
        return w_cur, codes.at[i].set(code), errs.at[i].set(err)

    _, codes, errs = jax.lax.fori_loop(0, wb.shape[0], body, (wb, jnp.zeros_like(wb), jnp.zeros_like(wb)))
    return codes, errs


def _gptq_act_order(w, x, group_size, asymmetric, damp, zero_point, clip):
    """Rows quantised in order of decreasing Hessian diagonal (the most active inputs first), with the group
    scales fixed up front (static groups: RTN's, or int4_clip_search's with `clip`) so the stored layout stays
    contiguous groups."""
    perm = jnp.argsort(-jnp.sum(x * x, axis=0))
    inv = jnp.argsort(perm)
    if clip:
        scales, zeros = int4_clip_search(w, x, group_size, asymmetric, zero_point)
    else:
        scales, zeros = int4_group_params(w, group_size, asymmetric, zero_point)
    s_rows = jnp.repeat(scales, group_size, axis=0)[perm]
    z_rows = (8.0 * jnp.ones_like(s_rows)) if zeros is None else jnp.repeat(zeros, group_size, axis=0)[perm]
    u = _inverse_hessian_cholesky(x[:, perm], damp)
    wp = w[perm]
    block = math.gcd(w.shape[0], 128)
    codes = []
    for b0 in range(0, w.shape[0], block):
        b1 = b0 + block
        c, err = _gptq_block_static(wp[b0:b1], u[b0:b1, b0:b1], s_rows[b0:b1], z_rows[b0:b1])
        wp = wp.at[b1:].add(-u[b0:b1, b1:].T @ err)
        codes.append(c)
    codes = jnp.concatenate(codes)[inv]
    return QuantizedArray(pack_int4(codes), scales, zeros, fmt="int4", group_size=group_size)


def _gptq_block_rows(k: int, fmt: str, group_size: int) -> int:
    if fmt == "int4":
        return group_size * math.gcd(k // group_size, max(1, 128 // group_size))
    return math.gcd(k, 128)


def gptq(
    w_kn,
    x_tk,
    *,
    fmt: str = "int4",
    group_size: int = 128,
    asymmetric: bool = True,
    damp: float = 0.01,
    act_order: bool = False,
    zero_point: str = "int",
    clip: bool = True,
):
    """GPTQ (Frantar et al. 2022), blocked lazy updates: int4 per group, int8 or fp8 (e4m3) per channel.

    Rows (input channels) are quantised in order; the rounding error of row i is compensated on rows > i by
    w[j] -= U[i, j] / U[i, i] * err, with U the upper Cholesky factor of the inverse Hessian of the inputs.
    `act_order` (int4): rows in order of decreasing input energy, group scales fixed beforehand (from
    int4_clip_search with `clip`, else RTN's). zero_point: int4_group_params.
    """
    if fmt not in ("int4", "int8", "fp8"):
        raise ValueError(f"gptq: fmt must be int4, int8 or fp8, got {fmt!r}")
    w = jnp.asarray(w_kn, jnp.float32)
    if fmt == "int4" and w.shape[0] % group_size:
        raise ValueError(f"gptq: K={w.shape[0]} is not a multiple of group_size={group_size}")
    asymmetric = asymmetric and fmt == "int4"  # int8 and fp8 are symmetric per channel
    if act_order and fmt == "int4":
        return _gptq_act_order(w, jnp.asarray(x_tk, jnp.float32), group_size, asymmetric, damp, zero_point, clip)
    u = _inverse_hessian_cholesky(jnp.asarray(x_tk, jnp.float32), damp)
    fixed = _safe(jnp.max(jnp.abs(w), axis=0) / (FP8_MAX if fmt == "fp8" else 127.0))
    block = _gptq_block_rows(w.shape[0], fmt, group_size)
    codes, scales, zeros = [], [], []
    for b0 in range(0, w.shape[0], block):
        b1 = b0 + block
        c, s, z, err = _gptq_block(
            w[b0:b1],
            u[b0:b1, b0:b1],
            fixed,
            fmt=fmt,
            group_size=group_size,
            asymmetric=asymmetric,
            zero_point=zero_point,
        )
        w = w.at[b1:].add(-u[b0:b1, b1:].T @ err)
        codes.append(c), scales.append(s), zeros.append(z)
    codes, scales, zeros = (jnp.concatenate(a) for a in (codes, scales, zeros))
    if fmt == "int8":
        return QuantizedArray(codes.astype(jnp.int8), fixed, fmt="int8")
    if fmt == "fp8":
        return QuantizedArray(codes.astype(jnp.float8_e4m3fn), fixed, fmt="fp8")
    return QuantizedArray(pack_int4(codes), scales, zeros if asymmetric else None, fmt="int4", group_size=group_size)


# ---------------------------------------------------------------------------------------------------------
# W8A8: SmoothQuant int8 and fp8.
# ---------------------------------------------------------------------------------------------------------
def smoothquant(w_kn, x_tk, *, alpha: float = 0.5):
    """SmoothQuant W8A8 int8: s = max|x_k|^alpha / max|w_k|^(1 - alpha); stores int8 diag(s) w per output channel,
    pre_scale = 1 / s, and int8 activations quantised per token."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant: alpha must lie in [0, 1], got {alpha}")
    w = jnp.asarray(w_kn, jnp.float32)
    a_max = jnp.maximum(jnp.max(jnp.abs(jnp.asarray(x_tk, jnp.float32)), axis=0), TINY)
    w_max = jnp.maximum(jnp.max(jnp.abs(w), axis=1), TINY)
    s = _safe(a_max**alpha / w_max ** (1.0 - alpha))
    q = rtn(w * s[:, None], "int8")
    return QuantizedArray(q.values, q.scales, fmt="int8", pre_scale=1.0 / s, act_fmt="int8")


def fp8_w8a8(w_kn, x_tk=None, *, static: bool = False, weights: str = "rtn"):
    """W8A8 fp8: e4m3 weights per channel; activations per token (dynamic) or, with `static`, one per-tensor scale
    calibrated as max|x| / 448 on the calibration inputs x.

    weights: "rtn" (amax / 448 scales, round to nearest), "search" (fp8_calibrated's scales) or "gptq" (GPTQ with
    e4m3 rounding: the weight error is compensated through the inputs' Hessian, leaving the activations' own
    e4m3 error as most of what is left); the last two need x.
    """
    if weights not in ("rtn", "search", "gptq"):
        raise ValueError(f"fp8_w8a8: weights must be rtn, search or gptq, got {weights!r}")
    if weights != "rtn" and x_tk is None:
        raise ValueError(f"fp8_w8a8: weights={weights!r} needs calibration inputs x_tk")
    if weights == "rtn":
        q = rtn(w_kn, "fp8")
    else:
        q = fp8_calibrated(w_kn, x_tk) if weights == "search" else gptq(w_kn, x_tk, fmt="fp8")
    act_scale = None
    if static:
        if x_tk is None:
            raise ValueError("fp8_w8a8: static activation scales need calibration inputs x_tk")
        act_scale = _safe(jnp.max(jnp.abs(jnp.asarray(x_tk, jnp.float32))) / ACT_MAX["fp8"])
    return QuantizedArray(q.values, q.scales, fmt="fp8", act_scale=act_scale, act_fmt="fp8")
