"""W8A8 prefill matmul on Hopper through Pallas Mosaic GPU: 8-bit x 8-bit wgmma with the scales in the epilogue.

    out [M, N] = (xq [M, K] @ wq [K, N]) * x_scale [M, 1] * w_scale [1, N]        (out in bf16 / f16)

Two formats, one kernel:
    fp8   xq, wq float8_e4m3fn; wgmma e4m3 x e4m3 with f32 accumulation, promoted every 128 of K (below)
    int8  xq, wq int8 (SmoothQuant W8A8);  wgmma s8 x s8 with s32 accumulation (exact), cast to f32 in the epilogue

Both are reachable from Pallas in jax 0.11.2: `plgpu.wgmma` takes 8-bit SMEM operands and a `plgpu.ACC` of int32
(signed, as s8 wgmma needs); tests/test_w8a8_matmul.py checks that the cuda lowering emits wgmma ...s32.s8.s8 and
...f32.e4m3.e4m3.

x_scale is per token (dynamic, `quantize_activations`: max|x_row| / 448 for e4m3, / 127 for int8) or one static
per-tensor scale broadcast to every row; w_scale is per output channel [N] or per tensor []. The scales never enter
the K loop: they multiply the accumulator once, in registers, before the bf16 store.

Layout. 8-bit wgmma reads both operands K-major from shared memory (PTX has no transposed 8-bit form), so the
kernel takes the weight as wq_nk [N, K]; `w8a8_matmul(..., wq_layout="kn")` transposes a [K, N] weight first
(one extra pass over the weight, K * N bytes), "nk" takes a pre-transposed one as is. The K tile is in bytes:
tile_k = 128 gives the 128-byte swizzle.

Structure (shared with pallas_kernels/grouped_matmul.py, whose pipeline builder and ladder stores it reuses):
one CTA per SM walks the (row block, column block) tiles of the output (with `cluster_m` = 2, CTA pairs walk pairs
of adjacent row blocks and share each weight tile by TMA multicast); per tile

    wg 0, 1  (compute): acc [tile_m, tile_n] += xq [tile_m, tile_k] @ wq_nk[cols, tile_k]^T over K (wgmma),
             the two warpgroups on the two tile_n halves of the CTA's 2 * tile_n columns; then
             out = acc * x_scale[rows, None] * w_scale[None, cols] -> bf16 -> SMEM -> GMEM (TMA).
    wg 2     (memory): TMA-loads xq and wq_nk tiles into a ring of `max_concurrent_steps` SMEM slots.

M needs no padding to the tile: the last row block's loads read past M (TMA fills zeros) and its stores write
only the valid rows (grouped_matmul.store_rows: one TMA box per set bit of the row count; or, with
`swizzled_epilogue`, whole boxes that the TMA unit clips at the output's row count). A TMA copy to or from a
swizzled SMEM tile describes the whole GMEM array in [8, swizzle] tiles, so that array's rows must be a multiple
of 8 (Mosaic GPU's TileTransform.transform_gmem_shape raises otherwise): xq is padded to ROW_ALIGN rows, and so is
the swizzled epilogue's output, whose padding rows are sliced off (`out_rows`). N must be a multiple of
2 * tile_n and K of tile_k (ValueError otherwise): the Llama-3-8B layer shapes are.

fp8 accumulation. Hopper's e4m3 wgmma does not add into its f32 accumulator at full f32 precision (DeepSeek-V3
reports about 14 bits kept and ~2% error at K = 4096; this kernel gave 2.56% at M = K = N = 4096 on the H200 against
0.26% in the interpreter, whose dot is exact). As DeepSeek-V3 and CUTLASS's non-"fast accumulation" fp8 GEMMs do,
the kernel promotes: the tensor core's accumulator sums `promote_every_k` K columns (default 128: one pipeline step
of 4 wgmma k32 instructions), then the compute warpgroup waits for its wgmmas and adds the accumulator into an f32
register total carried through the K loop. A span of one step sums each step into a fresh accumulator, read straight
back; a longer span resets the one accumulator to zero (under lax.cond) and the epilogue adds its last partial
span. It costs a full wgmma wait per span (no wgmma left in flight across that step) and the total's registers
(hence MAX_PROMOTED_TILE). int8's s32 accumulation is exact and never promotes.

Interpreter (CPU tests, backend="interpret"): jax 0.11.2's Mosaic GPU interpreter runs the kernel unchanged, except
a promotion span of several steps, whose accumulator reset (a store into a wgmma accumulator) it cannot run
(ValueError; the GPU tests and the cuda lowering test on CPU cover that path).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import backend as backend_lib
from pallas_kernels import grouped_matmul as gm

COMPUTE_WGS = gm.COMPUTE_WGS
ROW_ALIGN = gm.ROW_ALIGN  # TMA loads of swizzled xq tiles need M % 8 == 0
INTERPRET_SMS = 4  # "SMs" of the persistent grid in the interpreter: 2 clusters of 2 when cluster_m = 2
ACT_MAX = {"fp8": 448.0, "int8": 127.0}
# Per-token scales are max|x| times these f32 reciprocals, not max|x| / ACT_MAX: XLA rewrites a divide by a constant
# into that multiply on the GPU (scales 1 ulp off IEEE division in 5% of rows on the H200), so writing it out keeps
# every quantiser (this one in XLA, pallas_kernels/act_quant.py in Triton or the interpreter) bit-identical.
ACT_RECIP = {fmt: float(np.float32(1.0 / v)) for fmt, v in ACT_MAX.items()}
DTYPES = {"fp8": jnp.dtype(jnp.float8_e4m3fn), "int8": jnp.dtype(jnp.int8)}
# Largest [tile_m, tile_n] of a warpgroup with fp8 promotion: accumulator + total are 2 * tile_m * tile_n / 128 f32
# registers a thread, 128 of the ~232 a compute thread gets beside the memory warpgroup (128 x 128 would need 256).
MAX_PROMOTED_TILE = 64 * 128


@dataclasses.dataclass(frozen=True)
class W8A8Config:
    """Tiles of the W8A8 matmul: a CTA computes [tile_m, 2 * tile_n] of the output per work item.

    Attributes:
        tile_m: rows per tile (64 or 128).
        tile_n: columns per compute warpgroup (multiple of 64, at most 256: one wgmma's N).
        tile_k: K depth of one pipeline step in elements = bytes (multiple of 64; 128 gives the 128-byte swizzle).
        max_concurrent_steps: SMEM ring depth of the memory warpgroup.
        epi_n: columns per epilogue chunk (multiple of 64 dividing tile_n).
        delay_release: 1 keeps one wgmma in flight across steps (a slot is released one step later).
        grid_minor_m: the persistent loop walks M fastest (True) or N fastest, in strips of `grid_tile_width`.
        grid_tile_width: strip width of that walk (L2 reuse of xq and wq between CTAs running together).
        swizzled_epilogue: stage the output in 128-byte-swizzled SMEM (bank-conflict-free register stores) and
            store whole [tile_m, epi_n] boxes, leaving the rows past M of the last row block to the TMA unit's
            bounds check (a tensor store never writes outside the array); False stages it unswizzled and writes
            only the valid rows (grouped_matmul.store_rows), the path grouped_matmul runs on the H200.
        cluster_m: 2 runs CTAs in pairs on adjacent row blocks of the same columns, each weight tile loaded once
            from L2 and multicast to both SMEM rings (halves the weight's L2 -> SMEM traffic); 1: no clusters.
        promote_every_k: fp8 only (int8 accumulates exactly in s32 and ignores it). K columns per promotion: the
            wgmma sums run in the tensor core's accumulator for this many K columns, are added into a separate
            f32 register total and the accumulator is reset (module docstring, "fp8 accumulation"). A multiple
            of tile_k; 0 turns promotion off (one accumulator over all of K, ~2.6% error at K = 4096 on the H200).
            The total doubles the accumulator registers, so fp8 with promotion needs tile_m * tile_n <=
            MAX_PROMOTED_TILE (checked by w8a8_matmul; `for_shape(n, "fp8")` picks tile_m = 64).

    The defaults are the structure of grouped_matmul's measured best with the K tile doubled to 128 bytes; they
    are not yet tuned on a GPU for 8-bit (benchmarks/w8a8_matmul.py sweeps them).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 4
    epi_n: int = 64
    delay_release: int = 1
    grid_minor_m: bool = True
    grid_tile_width: int = 8
    swizzled_epilogue: bool = False
    cluster_m: int = 1
    promote_every_k: int = 128

    def __post_init__(self):
        if self.tile_m not in (64, 128):
            raise ValueError(f"W8A8Config.tile_m must be 64 or 128, got {self.tile_m}")
        if self.tile_n % 64 or not 0 < self.tile_n <= 256 or self.tile_k % 64 or self.tile_k <= 0:
            raise ValueError(f"W8A8Config.tile_n (<= 256) and tile_k must be positive multiples of 64, got {self}")
        if self.epi_n % 64 or self.tile_n % self.epi_n:
            raise ValueError(f"W8A8Config.epi_n must be a multiple of 64 dividing tile_n, got {self}")
        if self.delay_release not in (0, 1):
            raise ValueError(f"W8A8Config.delay_release must be 0 or 1, got {self.delay_release}")
        if self.max_concurrent_steps <= self.delay_release or self.max_concurrent_steps < 2:
            raise ValueError(f"W8A8Config.max_concurrent_steps must be >= 2 and > delay_release, got {self}")
        if self.grid_tile_width < 1:
            raise ValueError(f"W8A8Config.grid_tile_width must be >= 1, got {self.grid_tile_width}")
        if self.cluster_m not in (1, 2):
            raise ValueError(f"W8A8Config.cluster_m must be 1 or 2, got {self.cluster_m}")
        if self.promote_every_k < 0 or self.promote_every_k % self.tile_k:
            raise ValueError(
                f"W8A8Config.promote_every_k must be 0 (off) or a positive multiple of tile_k={self.tile_k}, "
                f"got {self.promote_every_k}"
            )
        if self.smem_bytes() > gm.SMEM_BYTES:
            raise ValueError(f"W8A8Config {self} needs {self.smem_bytes()} bytes of SMEM > {gm.SMEM_BYTES}")

    def smem_bytes(self, out_itemsize: int = 2) -> int:
        ring = self.max_concurrent_steps * (self.tile_m + COMPUTE_WGS * self.tile_n) * self.tile_k  # 1 byte each
        return ring + out_itemsize * COMPUTE_WGS * self.tile_m * self.epi_n

    def promotes(self, fmt: str) -> bool:
        """Whether the kernel promotes partial sums for `fmt` (fp8 with promote_every_k > 0)."""
        return fmt == "fp8" and self.promote_every_k > 0

    @classmethod
    def for_shape(cls, n: int, fmt: str) -> W8A8Config:
        """The default tiles for an output width n: the widest tile_n (128 or 64) with n % (2 * tile_n) == 0; fp8
        (promoted every 128 of K) takes tile_m = 64, so the f32 total fits beside the accumulator in registers."""
        cfg = cls() if n % (COMPUTE_WGS * 128) == 0 else cls(tile_n=64)
        if cfg.promotes(fmt) and cfg.tile_m * cfg.tile_n > MAX_PROMOTED_TILE:
            cfg = dataclasses.replace(cfg, tile_m=64)
        return cfg


def supports(fmt: str, k: int, n: int) -> bool:
    """Whether the kernel takes an [M, k] @ [k, n] W8A8 matmul of format `fmt` with its default tiles."""
    cfg = W8A8Config.for_shape(n, fmt)
    return fmt in DTYPES and k % cfg.tile_k == 0 and n % (COMPUTE_WGS * cfg.tile_n) == 0


def quantize_activations(x: jax.Array, fmt: str, act_scale: jax.Array | None = None):
    """x [..., K] -> (xq [..., K] in the 8-bit dtype, x_scale [..., 1] float32) with x ~= xq * x_scale.

    Per token (each row's own max|x| / ACT_MAX; an all-zero row gets scale 1) unless a static per-tensor
    `act_scale` [] is given. int8 rounds to nearest and clips to +-127; fp8 clips to +-448 and rounds to e4m3.
    """
    if fmt not in DTYPES:
        raise ValueError(f"quantize_activations: fmt must be one of {tuple(DTYPES)}, got {fmt!r}")
    x32 = x.astype(jnp.float32)
    if act_scale is None:
        amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax * ACT_RECIP[fmt], 1.0)
    else:
        scale = jnp.broadcast_to(jnp.asarray(act_scale, jnp.float32), (*x.shape[:-1], 1))
    if fmt == "int8":
        q = jnp.clip(jnp.round(x32 / scale), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(x32 / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q, scale


# Layer 1: the kernel -----------------------------------------------------------------------------------------------


def _kernel(xq_gmem, wq_gmem, xs_gmem, ws_gmem, out_gmem, *, cfg: W8A8Config):
    # xq_gmem: [M8, K] e4m3 / int8, M8 = M rounded up to 8
    # wq_gmem: [N, K] same dtype, K-major
    # xs_gmem: [cdiv(grid_m, cluster_m) * cluster_m * tile_m] f32 per-row scale (padded with ones past M)
    # ws_gmem: [N] f32 per-column scale
    # out_gmem: [out_rows(M), N] bf16 / f16 (M, or M8 with the swizzled epilogue)
    m, n = out_gmem.shape
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_n = COMPUTE_WGS * tn
    grid_m, grid_n = pl.cdiv(m, tm), n // cta_n
    acc_dtype = jnp.int32 if xq_gmem.dtype == jnp.int8 else jnp.float32
    # fp8 promotion: K steps per promoted span (0: none; the accumulator sums all of K, as int8's exact s32 does)
    span = cfg.promote_every_k // cfg.tile_k if acc_dtype == jnp.float32 else 0
    pairs_m = pl.cdiv(grid_m, cfg.cluster_m)  # row blocks of one cluster: cluster_m adjacent ones, same columns
    b_collective = ("cluster",) if cfg.cluster_m > 1 else ()
    pipeline = functools.partial(
        gm.k_pipeline, cfg, xq_gmem.shape[1], xq_gmem.dtype, b_k_major=True, b_collective=b_collective
    )

    def ignore(*_, **__):
        return None

    zero = jnp.int32(0)
    allocs = pipeline(ignore, ignore, zero, zero).get_allocations(xq_gmem, wq_gmem)

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=allocs,
        out_smem=plgpu.SMEM((COMPUTE_WGS, tm, cfg.epi_n), out_gmem.dtype, transforms=_out_transforms(cfg, out_gmem)),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cluster") if cfg.cluster_m > 1 else 0

        @plgpu.nd_loop((pairs_m * grid_n,), collective_axes="sm")
        def _work_item(loop_info: plgpu.NDLoopInfo):
            (lin,) = loop_info.index
            pi, ni = plgpu.planar_snake(lin, (pairs_m, grid_n), 0 if cfg.grid_minor_m else 1, cfg.grid_tile_width)
            mi = pi * cfg.cluster_m + cta  # an odd grid_m leaves the last pair's second block wholly past M
            col = ni * cta_n + wg * tn
            rows = jnp.clip(m - mi * tm, 0, tm)

            def compute_context(eval_pipeline):
                # Scales are read before the K loop so their latency hides behind it: [tile_m] per row, [tile_n]
                # per column, in the layouts that broadcast onto the wgmma accumulator.
                # (GMEM loads into a register layout have no vectorised form in Mosaic GPU: optimized=False.)
                row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
                xs = plgpu.load(xs_gmem.at[pl.ds(mi * tm, tm)], layout=row_layout, optimized=False)
                ws = plgpu.load(ws_gmem.at[pl.ds(col, tn)], layout=col_layout, optimized=False)

                def epilogue(acc):  # acc: [tile_m, tile_n] f32 in the WGMMA layout
                    acc = acc * lax.broadcast_in_dim(xs, (tm, tn), [0]) * lax.broadcast_in_dim(ws, (tm, tn), [1])
                    out = acc.astype(out_gmem.dtype)
                    if cfg.swizzled_epilogue:
                        _store_boxes(out_smem.at[wg], out_gmem, cfg, mi * tm, col, out)
                    else:
                        gm.store_rows(out_smem.at[wg], out_gmem, cfg, mi * tm, 0, rows, col, out)

                # With promotion the f32 total of the spans rides in the K loop's carry, in registers.
                zeros = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA) if span else None
                if span == 1:  # each step sums into its own accumulator (mma_body): no accumulator lives across K
                    epilogue(eval_pipeline(zeros))
                    return

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), acc_dtype))
                def _acc_scope(acc_ref):
                    if span:  # acc_ref holds the last partial span (zeros when the span divides the K steps)
                        epilogue(eval_pipeline((acc_ref, zeros))[1] + acc_ref[...])
                    else:
                        eval_pipeline(acc_ref)
                        epilogue(acc_ref[...].astype(jnp.float32))  # int32 -> f32 rounds to 24 bits (<< bf16's 8)

            def mma_body(indices, a_smem, b_smem, carry):
                # a_smem: [tile_m, tile_k]; b_smem: [2 * tile_n, tile_k] K-major, this warpgroup's half of its rows.
                # carry: acc_ref (no promotion); total [tile_m, tile_n] f32 in the WGMMA layout (span 1);
                # (acc_ref, total) (spans of several steps).
                b_half = b_smem.at[pl.ds(wg * tn, tn)].transpose((1, 0))
                if not span:
                    plgpu.wgmma(carry, a_smem, b_half)
                    plgpu.wgmma_wait(cfg.delay_release)
                    return carry
                if span == 1:  # every step is a span: a fresh accumulator, read back (the read waits: wait_group 0)

                    @functools.partial(pl.run_scoped, step_acc=plgpu.ACC((tm, tn), jnp.float32))
                    def step_sum(step_acc):
                        plgpu.wgmma(step_acc, a_smem, b_half)
                        return step_acc[...]

                    return carry + step_sum

                acc_ref, total = carry
                plgpu.wgmma(acc_ref, a_smem, b_half)

                def promote(total):
                    total = total + acc_ref[...]  # the read waits for every wgmma in flight (wait_group 0)
                    acc_ref[...] = jnp.zeros((tm, tn), jnp.float32)  # the store fences before the next wgmma
                    return total

                def keep(total):
                    plgpu.wgmma_wait(cfg.delay_release)
                    return total

                (kk,) = indices
                return acc_ref, lax.cond((kk + 1) % span == 0, promote, keep, total)

            pipeline(mma_body, compute_context, mi, ni)(xq_gmem, wq_gmem, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _out_transforms(cfg: W8A8Config, out_gmem):
    """out_smem [wg, tile_m, epi_n]: 128-byte swizzled tiles for the swizzled epilogue, else plain rows."""
    if not cfg.swizzled_epilogue:
        return ()
    swizzle = plgpu.find_swizzle(cfg.epi_n * jnp.dtype(out_gmem.dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(out_gmem.dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _store_boxes(out_smem, out_gmem, cfg: W8A8Config, row0, col0, tile):
    """Writes `tile` [tile_m, tile_n] (registers) to out_gmem[row0:, col0:] as whole [tile_m, epi_n] TMA boxes."""
    # out_smem: [tile_m, epi_n] this warpgroup's swizzled staging buffer
    for c in range(cfg.tile_n // cfg.epi_n):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's store has read out_smem
        out_smem[...] = tile[:, c * cfg.epi_n : (c + 1) * cfg.epi_n]
        plgpu.commit_smem()
        rows, cols = pl.ds(row0, cfg.tile_m), pl.ds(col0 + c * cfg.epi_n, cfg.epi_n)
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, cols])


# Layer 2: the pallas_call builder ----------------------------------------------------------------------------------


def out_rows(m: int, cfg: W8A8Config) -> int:
    """Rows of the kernel's output array for M rows: M, or with the swizzled epilogue M rounded up to ROW_ALIGN.

    The swizzled epilogue's TMA store tiles the whole output array in [8, swizzle] boxes, which needs its row count
    to be a multiple of 8 (M = 333 failed to compile on the H200); the padding rows are computed from xq's zero
    padding and sliced off by `_w8a8_call`.
    """
    return pl.cdiv(m, ROW_ALIGN) * ROW_ALIGN if cfg.swizzled_epilogue else m


def _w8a8_call(xq, wq_nk, x_scale, w_scale, cfg: W8A8Config, out_dtype, interpret, num_sms: int):
    m, n = xq.shape[0], wq_nk.shape[0]
    m_out = out_rows(m, cfg)
    rows = pl.cdiv(pl.cdiv(m, cfg.tile_m), cfg.cluster_m) * cfg.cluster_m * cfg.tile_m
    xs = jnp.pad(x_scale.reshape(m).astype(jnp.float32), (0, rows - m), constant_values=1.0)
    ws = jnp.broadcast_to(w_scale.astype(jnp.float32).reshape(-1), (n,))
    if m % ROW_ALIGN:  # the padded rows are loaded, multiplied and never stored
        xq = jnp.pad(xq, ((0, ROW_ALIGN - m % ROW_ALIGN), (0, 0)))
    cluster = dict(cluster=(cfg.cluster_m,), cluster_names=("cluster",)) if cfg.cluster_m > 1 else {}
    call = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=backend_lib.out_struct((m_out, n), out_dtype, [xq, wq_nk]),
        grid=(num_sms // cfg.cluster_m,),
        grid_names=("sm",),
        **cluster,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    out = call(xq, wq_nk, xs, ws)
    return out if m_out == m else out[:m]


# Layer 3: the validated, jitted entry point ------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("wq_layout", "out_dtype", "config", "interpret", "num_sms"))
def _w8a8_jit(xq, wq, x_scale, w_scale, *, wq_layout, out_dtype, config, interpret, num_sms):
    wq_nk = wq.T if wq_layout == "kn" else wq
    return _w8a8_call(xq, wq_nk, x_scale, w_scale, config, out_dtype, interpret, num_sms)


def _validate(xq, wq, x_scale, w_scale, wq_layout, out_dtype, cfg: W8A8Config):
    if wq_layout not in ("kn", "nk"):
        raise ValueError(f"w8a8_matmul: wq_layout must be 'kn' or 'nk', got {wq_layout!r}")
    if xq.ndim != 2 or wq.ndim != 2:
        raise ValueError(f"w8a8_matmul: expected xq [M, K] and wq 2-D, got {xq.shape}, {wq.shape}")
    m, k = xq.shape
    k2, n = wq.shape if wq_layout == "kn" else wq.shape[::-1]
    if k != k2:
        raise ValueError(f"w8a8_matmul: xq K={k} does not match wq K={k2} (wq_layout={wq_layout!r})")
    if xq.dtype != wq.dtype or xq.dtype not in DTYPES.values():
        raise ValueError(f"w8a8_matmul: xq and wq must both be float8_e4m3fn or int8, got {xq.dtype}, {wq.dtype}")
    if x_scale.size != m or (x_scale.ndim == 2 and x_scale.shape != (m, 1)) or x_scale.ndim > 2:
        raise ValueError(f"w8a8_matmul: x_scale must be [M, 1] or [M] with M={m}, got {x_scale.shape}")
    if w_scale.size not in (1, n) or w_scale.ndim > 2 or (w_scale.ndim == 2 and w_scale.shape[0] != 1):
        raise ValueError(f"w8a8_matmul: w_scale must be [1, N], [N] or per-tensor [] with N={n}, got {w_scale.shape}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"w8a8_matmul: out_dtype must be bfloat16 or float16, got {out_dtype}")
    if k % cfg.tile_k:
        raise ValueError(f"w8a8_matmul: K={k} is not a multiple of config.tile_k={cfg.tile_k}")
    if n % (COMPUTE_WGS * cfg.tile_n):
        raise ValueError(f"w8a8_matmul: N={n} is not a multiple of 2 * config.tile_n={COMPUTE_WGS * cfg.tile_n}")
    if xq.dtype == DTYPES["fp8"] and cfg.promotes("fp8") and cfg.tile_m * cfg.tile_n > MAX_PROMOTED_TILE:
        raise ValueError(
            f"w8a8_matmul: fp8 with config.promote_every_k={cfg.promote_every_k} keeps an f32 total beside the "
            f"accumulator, which needs tile_m * tile_n <= {MAX_PROMOTED_TILE} (got {cfg.tile_m} x {cfg.tile_n}): "
            "use tile_m=64 or tile_n=64, or promote_every_k=0"
        )


def w8a8_matmul(
    xq: jax.Array,
    wq: jax.Array,
    x_scale: jax.Array,
    w_scale: jax.Array,
    *,
    wq_layout: str = "kn",
    out_dtype=jnp.bfloat16,
    config: W8A8Config | None = None,
    backend: str | None = None,
) -> jax.Array:
    """(xq @ wq) * x_scale * w_scale in `out_dtype`, with 8-bit operands on Hopper's 8-bit tensor cores.

    Args:
        xq: [M, K] float8_e4m3fn or int8 activations (`quantize_activations`).
        wq: the weight, same dtype: [K, N] (wq_layout="kn") or [N, K] ("nk", what the kernel reads; no transpose).
        x_scale: [M, 1] or [M] float per-row scale (a static per-tensor scale broadcast to every row).
        w_scale: [1, N] or [N] per output channel, or [] / [1] per tensor.
        wq_layout: "kn" or "nk", as above.
        out_dtype: bfloat16 or float16.
        config: tiles and fp8 promotion; default `W8A8Config.for_shape(N, fmt)`.
        backend: None (Mosaic GPU on Hopper, else the XLA reference), "mosaic_gpu", "interpret" (the Mosaic GPU
            interpreter, for CPU tests) or "xla" (`reference`). There is no Triton version.

    Returns:
        [M, N] in out_dtype (f32 accumulation for fp8, promoted every config.promote_every_k of K; exact int32
        for int8; scales applied in f32).

    Raises:
        ValueError: shapes, dtypes or layouts that do not match, K or N not a multiple of the tiles, or an unusable
            backend.
    """
    if backend == "triton":
        raise ValueError("w8a8_matmul: backend 'triton' is not implemented; use 'mosaic_gpu', 'interpret' or 'xla'")
    if backend is None:
        backend = "mosaic_gpu" if backend_lib.device_supports("mosaic_gpu") else "xla"
    backend = backend_lib.resolve_backend(backend, "w8a8_matmul")
    n = wq.shape[-1] if wq_layout == "kn" else wq.shape[0]
    fmt = "int8" if xq.dtype == DTYPES["int8"] else "fp8"
    cfg = config or W8A8Config.for_shape(n, fmt)
    _validate(xq, wq, x_scale, w_scale, wq_layout, out_dtype, cfg)
    cfg = gm.one_step_safe(cfg, xq.shape[1])
    if backend == "xla":
        return reference(xq, wq, x_scale, w_scale, wq_layout=wq_layout, out_dtype=out_dtype)
    if xq.shape[0] == 0:
        return jnp.zeros((0, n), out_dtype)
    if backend == "interpret" and cfg.promotes(fmt) and cfg.promote_every_k > cfg.tile_k:
        # a span of several steps resets its accumulator by a register store, which jax 0.11.2's interpreter lacks
        raise ValueError(
            f"w8a8_matmul: backend 'interpret' takes fp8 config.promote_every_k of 0 or tile_k={cfg.tile_k} only, "
            f"got {cfg.promote_every_k}"
        )
    interpret = plgpu.InterpretGPUParams() if backend == "interpret" else None
    sms = INTERPRET_SMS if interpret is not None else gm.num_sms()
    return _w8a8_jit(
        xq,
        wq,
        jnp.asarray(x_scale),
        jnp.asarray(w_scale),
        wq_layout=wq_layout,
        out_dtype=jnp.dtype(out_dtype),
        config=cfg,
        interpret=interpret,
        num_sms=sms,
    )


# Layer 4: the reference --------------------------------------------------------------------------------------------


def reference(xq, wq, x_scale, w_scale, *, wq_layout: str = "kn", out_dtype=jnp.bfloat16, **_) -> jax.Array:
    """The same product in plain jnp: exact f32 products of the 8-bit values (HIGHEST), then the two scales."""
    w = (wq.T if wq_layout == "nk" else wq).astype(jnp.float32)
    acc = jnp.dot(xq.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    xs = jnp.asarray(x_scale, jnp.float32).reshape(-1, 1)
    ws = jnp.asarray(w_scale, jnp.float32).reshape(1, -1)
    return (acc * xs * ws).astype(out_dtype)


def exact_reference(xq, wq, x_scale, w_scale, *, wq_layout: str = "kn") -> jax.Array:
    """The product in f32, never through an 8-bit dot: the f32 upcasts sit behind an optimization barrier, so XLA
    on a GPU cannot fold them back into an fp8 cuBLASLt GEMM (which accumulates as the tensor core does and would
    share the kernel's error); an f32 dot at HIGHEST, the scales, f32 out (no bf16 rounding). The oracle of the GPU
    tests and of benchmarks/w8a8_matmul.py."""
    w = (wq.T if wq_layout == "nk" else wq).astype(jnp.float32)
    x, w = lax.optimization_barrier((xq.astype(jnp.float32), w))
    acc = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return acc * jnp.asarray(x_scale, jnp.float32).reshape(-1, 1) * jnp.asarray(w_scale, jnp.float32).reshape(1, -1)
