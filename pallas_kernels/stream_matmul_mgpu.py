"""Weight-streaming matmul for small M (decode) on Hopper, through Pallas Mosaic GPU (TMA ring + wgmma, swap AB).

    x [M, K] @ w [K, N]  ==  (W^T [N, K] @ x^T [K, M])^T       M <= 256 rows, weight bf16 | int8 | fp8 e4m3 | int4

"Swap AB": the weight is wgmma's A operand (R = `wg_rows`, 64 or 128 rows of N per compute warpgroup, loaded from
SMEM into registers and converted to bf16 there) and the few activation rows are B's narrow N dimension (M padded
to Mp, a multiple of 8: wgmma N runs 8..256 in steps of 8), so a decode GEMV does not pad M to 64.

Stored layout (`prepare`, once at quantisation / load time, never per call): `StreamWeight`
    wt      [Np, Kp]  the weight transposed (K contiguous), N padded to N_ALIGN and K to K_ALIGN with zeros:
                      bf16 / f16 | int8 | float8_e4m3fn | int4 (jnp.int4, signed codes c - 8, packed by XLA along K)
    scales  int8 / fp8: f32 [N] (a per-tensor fp8 scale is broadcast);  int4: f32 [Kp/g, Np] group scales
    zshift  int4 asymmetric: f32 [Kp/g, Np] = zero_point - 8 (None: symmetric), so w = (c' - zshift) * scale

Grid (Np / 2R, S): CTA (i, s) owns rows [2R i, 2R i + 2R) of out^T and K steps [s * T, (s + 1) * T) of tile_k:
    wg 2     (memory):  TMA ring of up to `max_concurrent_steps` slots: per step the weight tile [2R, tile_k] and
             x [Mp, tile_k] (int4: blocks of max(g, 64) columns for both, and the step's scales [tile_k/g, 2R])
    wg 0, 1  (compute): a = wt tile rows [R wg, R wg + R) -> registers -> bf16;  acc [R, Mp] += a @ x_tile^T
             (bf16 weights: A straight from SMEM; e4m3 goes through f16, the only conversion Hopper has; exact)
             int4: a = (c' - zshift[group]) * scale[group] in f32, rounded once to bf16, then wgmma: the same
                   numbers as dequantising the weight to bf16 first (one rounding per weight element).
    epilogue: acc -> SMEM in 16-column chunks -> partials [S * Np, Mp] f32 (TMA stores).
After the kernel, one XLA fusion: sum the S partials, multiply by the int8 / fp8 per-channel scale (exact, f32),
transpose to [M, N] and cast. f32 partials cost S * N * Mp * 4 bytes (`plan` keeps them under a quarter of the
weight's bytes) and a second small kernel per call.

Interpreter (CPU tests, `interpret=plgpu.InterpretGPUParams()`): runs the same kernel (ring, barriers, stores), except
that its wgmma reads refs only, so A always reaches it through the SMEM staging tile (`a_via_smem`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend as backend_lib
from pallas_kernels.quantized_matmul import FORMATS, reference  # noqa: F401  (reference: the shared oracle)
from pallas_kernels.quantized_matmul import _validate as _validate_stored

COMPUTE_WGS = 2
N_ALIGN = 256  # N padding of the stored weight: whole CTAs of 2 warpgroups x 64 or 128 rows
K_ALIGN = 256  # K padding of the stored weight: every tile_k (64, 128, 256; int4 up to 512 via groups) divides it
MAX_ROWS = 256  # wgmma N limit: rows of x per call
MEMORY_REGISTERS = 40
SMEM_BYTES = 227 * 1024
SMEM_RESERVE = 1024  # the pipeline's barriers and alignment (Mosaic GPU counted 48 bytes over a 227 KB estimate)
KERNEL_NAME = "stream_matmul_mgpu"
INTERPRET_SMS = 4  # "SMs" in the interpreter: few, so that small tests still split K
_CODE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Tiles of the streaming kernel (a static argument).

    Attributes:
        tile_k: most K columns per pipeline step (64..512; int4 at least one group); halved where SMEM needs it;
            0: 256 bytes of weight a row (bf16 128, int8 / fp8 256, int4 512), 32 KB of weight a slot at wg_rows 64.
        max_concurrent_steps: most SMEM ring slots (fewer where SMEM does not hold them; bytes in flight per SM =
            slots * 2 * wg_rows * tile_k * weight bytes).
        num_splits: K splits across CTAs (f32 partials summed after); 0 picks one wave of CTAs, fewer where the
            partials would pass a quarter of the weight's bytes (`plan`).
        a_via_smem: int8 / fp8 / int4 hand the converted A tile to wgmma through SMEM instead of registers (what
            the interpreter always does; on the GPU a fallback and a point of the sweep).
        wg_rows: rows of N per compute warpgroup, 64 or 128 (one or two wgmma row tiles); 0: `plan` picks.
        cluster: CTAs of a cluster (neighbouring N blocks) that share each x block through TMA multicast: x is
            re-read from L2 by every CTA otherwise, as many bytes as an int4 weight tile at M = 64 (1 where the N
            blocks do not divide).
        overlap: registers-A path with several blocks a step: dequantise block j + 1 while block j's wgmma
            runs, as the FA3-style kernels keep p in registers across a wgmma (opt-in until measured). int4's blocks
            are its groups; int8 / fp8 steps are cut into blocks of 64 columns for it (one block a step otherwise).
        upcast_load: int8 / fp8: read the A tile from SMEM 4 bytes a thread (Mosaic GPU's WGMMA_UPCAST_2X layout)
            and move the converted bf16 values to wgmma's register layout with one warp shuffle a register pair;
            the default loads it straight in that layout, 2 bytes a thread, each load with its own swizzled address
            and each 2-element conversion padded to 32 bits (opt-in until measured on a GPU).
    """

    tile_k: int = 0
    max_concurrent_steps: int = 4
    num_splits: int = 0
    a_via_smem: bool = False
    wg_rows: int = 0
    cluster: int = 1
    overlap: bool = False
    upcast_load: bool = False

    def __post_init__(self):
        if self.tile_k not in (0, 64, 128, 256, 512):
            raise ValueError(f"StreamConfig.tile_k must be 0 (auto), 64, 128, 256 or 512, got {self.tile_k}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"StreamConfig.max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
        if self.num_splits < 0:
            raise ValueError(f"StreamConfig.num_splits must be >= 0 (0 = auto), got {self.num_splits}")
        if self.wg_rows not in (0, 64, 128):
            raise ValueError(f"StreamConfig.wg_rows must be 0 (auto), 64 or 128, got {self.wg_rows}")
        if self.cluster not in (1, 2, 4):
            raise ValueError(f"StreamConfig.cluster must be 1, 2 or 4, got {self.cluster}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamWeight:
    """A weight [K, N] in this kernel's layout (see the module docstring); built once by `prepare`."""

    wt: jax.Array
    scales: jax.Array | None = None
    zshift: jax.Array | None = None
    fmt: str = dataclasses.field(default="bf16", metadata=dict(static=True))
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))
    k: int = dataclasses.field(default=0, metadata=dict(static=True))
    n: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return self.k, self.n


def _pad2(a, rows, cols):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def prepare(values, scales=None, zeros=None, *, fmt="bf16", group_size=0) -> StreamWeight:
    """The stored weight of pallas_kernels/quantized_matmul.py (model/quant.py layouts) -> this kernel's layout.

    Args:
        values: bf16/f16 [K, N], int8 [K, N], float8_e4m3fn [K, N] or uint8 [K/2, N] (int4: row 2i low nibble).
        scales: int8 / fp8 f32 [N] or []; int4 [K/g, N]; None for bf16.
        zeros: int4 [K/g, N] zero points (GGUF Q4_1's are not integers) or None (symmetric, zero 8).
        fmt, group_size: as in quantized_matmul.

    Raises:
        ValueError: an unknown format, a bad group size or shapes that do not fit (quantized_matmul's checks).
    """
    k = 2 * values.shape[0] if fmt == "int4" else values.shape[0]
    _validate_stored(jnp.zeros((1, k), jnp.bfloat16), values, scales, zeros, fmt, group_size)
    n = values.shape[1]
    np_, kp = -(-n // N_ALIGN) * N_ALIGN, -(-k // K_ALIGN) * K_ALIGN
    if fmt == "int4":
        codes = jnp.stack([values & 0xF, values >> 4], axis=1).reshape(k, n).astype(jnp.int8) - 8  # [K, N]
        wt = _pad2(codes.T, np_, kp).astype(jnp.int4)  # padded K columns are code 8 (zero) with scale 0
        groups = kp // group_size
        s = _pad2(scales.astype(jnp.float32), groups, np_)
        z = None if zeros is None else _pad2(zeros.astype(jnp.float32) - 8.0, groups, np_)
        return StreamWeight(wt, s, z, fmt, group_size, k, n)
    wt = _pad2(values.T, np_, kp)
    s = None if fmt == "bf16" else jnp.broadcast_to(scales.astype(jnp.float32), (n,))
    return StreamWeight(wt, s, None, fmt, 0, k, n)


@functools.cache
def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


@dataclasses.dataclass(frozen=True)
class _Plan:
    mp: int  # x rows padded to a multiple of 8 (wgmma N)
    tk: int  # K columns per step
    kb: int  # K columns per block (tk, or int4: one group, two when g = 32)
    steps: int  # steps per split
    splits: int
    n_blocks: int  # CTAs along N
    wg_rows: int  # rows of N per compute warpgroup
    cluster: int  # CTAs sharing x by multicast
    depth: int  # ring slots
    smem: int  # bytes of SMEM per CTA

    @property
    def cta_rows(self) -> int:
        return COMPUTE_WGS * self.wg_rows


def plan(m: int, w: StreamWeight, config: StreamConfig, num_sms: int) -> _Plan:
    """The call's geometry. tile_k and the ring depth are upper bounds: both shrink until the ring fits in SMEM
    (x's block grows with M: at 256 rows a [256, 128] bf16 block is 64 KB a slot)."""
    mp = max(8, -(-m // 8) * 8)
    # 128 rows a warpgroup halve the CTAs that re-read x's block; not past 128 rows of x (an f32 acc of [128, Mp]
    # is Mp regs a thread) and not for int4, whose f32 dequantisation of a [128, kb] tile alone is 128 regs.
    wg_rows = config.wg_rows or (128 if 32 <= mp <= 128 and w.fmt != "int4" else 64)
    tk, floor = config.tile_k or {"int4": 512, "int8": 256, "fp8": 256}.get(w.fmt, 128), 64
    if w.fmt == "int4":
        tk, floor = max(tk, w.group_size), max(64, w.group_size)
        if tk % w.group_size:
            raise ValueError(f"StreamConfig.tile_k={tk} must be a multiple of the int4 group size {w.group_size}")
    while not config.tile_k and w.wt.shape[1] % tk:  # auto: the largest that divides K (K_ALIGN always does)
        tk //= 2
    if w.wt.shape[1] % tk:
        raise ValueError(f"StreamConfig.tile_k={tk} does not divide the stored K={w.wt.shape[1]}")
    p = _fit(mp, tk, wg_rows, w, config, num_sms)
    while p.smem > SMEM_BYTES and p.tk > floor:
        p = _fit(mp, p.tk // 2, wg_rows, w, config, num_sms)
    return p


def _fit(mp: int, tk: int, wg_rows: int, w: StreamWeight, config: StreamConfig, num_sms: int) -> _Plan:
    np_, kp = w.wt.shape
    total = kp // tk
    n_blocks = np_ // (COMPUTE_WGS * wg_rows)
    # Auto: one wave (the ring takes most of an SM's SMEM: one CTA per SM), and f32 partials (S * N * Mp * 4 bytes,
    # written and summed again) at most a quarter of the weight's bytes.
    bits = 4 if w.fmt == "int4" else 8 * jnp.dtype(w.wt.dtype).itemsize
    weight_bytes = np_ * kp * bits // 8
    splits = config.num_splits or max(1, min(num_sms // n_blocks, weight_bytes // (16 * np_ * mp)))
    splits = max(d for d in range(1, total + 1) if total % d == 0 and d <= splits)  # equal static step counts
    kb = max(w.group_size, 64) if w.fmt == "int4" else tk  # int4 blocks of 32 columns would be 16-byte rows
    if config.overlap and w.fmt in ("int8", "fp8"):
        kb = 64  # several blocks a step, so that converting block j + 1 overlaps block j's wgmma
    steps = total // splits
    # SMEM: per slot x [Mp, tk] + weight [2 wg_rows, tk] (+ int4 scales / shifts), plus the f32 epilogue buffer,
    # the optional bf16 A staging tile and the barriers.
    per_slot = mp * tk * 2 + COMPUTE_WGS * wg_rows * tk * bits // 8
    if w.fmt == "int4":
        per_slot += (1 + (w.zshift is not None)) * (tk // w.group_size) * COMPUTE_WGS * wg_rows * 4
    staging = kb * 2 if config.a_via_smem and w.fmt != "bf16" else 0
    fixed = COMPUTE_WGS * wg_rows * (_epi_cols(mp) * 4 + staging) + SMEM_RESERVE
    depth = min(config.max_concurrent_steps, steps)
    while depth > min(2, steps) and depth * per_slot + fixed > SMEM_BYTES:
        depth -= 1
    cluster = config.cluster if n_blocks % config.cluster == 0 else 1
    return _Plan(mp, tk, kb, steps, splits, n_blocks, wg_rows, cluster, depth, depth * per_slot + fixed)


def _epi_cols(mp: int) -> int:
    """Columns of out^T per epilogue chunk (f32 SMEM staging of [wg_rows, 16] instead of [wg_rows, Mp])."""
    return 16 if mp % 16 == 0 else 8


# Layer 1: the kernel -----------------------------------------------------------------------------------------------


def _swizzled(block_cols: int, dtype):
    """Tiling + swizzle transforms for an SMEM block whose rows hold `block_cols` elements of `dtype`."""
    bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
    swizzle = plgpu.find_swizzle(block_cols * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _dequant_tile(w_rows, gs, j, wg, fmt, has_zeros, compute_dtype, group_size, upcast_load=False):
    """Codes [R, kb] in SMEM (R = wg_rows) -> the dequantised A tile [R, kb] in registers (compute dtype).

    int8 / e4m3 convert to bf16 exactly (their per-channel scale is applied to out^T after the kernel); int4 block j
    of the step: (c' - zshift) * scale in f32, rounded once to bf16, as dequantising the weight to bf16 would. A
    64-column block holds two groups when g = 32: each column picks its group's row value.
    """
    upcast = upcast_load and fmt in ("int8", "fp8")  # 32-bit SMEM loads, then one shuffle to wgmma's layout
    a = plgpu.load(w_rows, layout=plgpu.Layout.WGMMA_UPCAST_2X) if upcast else w_rows[...]
    if fmt == "fp8" and compute_dtype == jnp.bfloat16:  # Hopper converts e4m3 to f16 only; both steps are exact
        a = a.astype(jnp.float16)
    a = a.astype(compute_dtype)
    if fmt != "int4":
        return plgpu.layout_cast(a, plgpu.Layout.WGMMA) if upcast else a
    kb = a.shape[1]
    per_block = kb // group_size
    rows = pl.ds(a.shape[0] * wg, a.shape[0])
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per row of the wgmma tile
    group_of_col = None
    if per_block > 1:
        group_of_col = plgpu.broadcasted_iota(jnp.int32, a.shape, 1, layout=plgpu.Layout.WGMMA) // group_size

    def per_group(ref):  # [tk / g, 2R] f32 in SMEM -> [R, kb] f32: each element's group value for its row
        tile = None
        for q in range(per_block):
            v = lax.broadcast_in_dim(plgpu.load(ref.at[j * per_block + q, rows], layout=row_layout), a.shape, [0])
            tile = v if tile is None else jnp.where(group_of_col == q, v, tile)
        return tile

    a32 = a.astype(jnp.float32)
    if has_zeros:
        a32 = a32 - per_group(gs[1])
    return (a32 * per_group(gs[0])).astype(compute_dtype)


def _kernel(*refs, p: _Plan, fmt, group_size, has_zeros, compute_dtype, a_via_smem, overlap, upcast_load=False):
    # x_gmem:  [Mp, Kp] compute dtype (rows >= M are zero)
    # w_gmem:  [Np, Kp] codes (module docstring)
    # s_gmem:  int4 [Kp/g, Np] f32 group scales;  z_gmem: int4 asymmetric [Kp/g, Np] f32 zero shifts
    # out_gmem: [S * Np, Mp] f32 partials of out^T
    x_gmem, w_gmem = refs[:2]
    out_gmem = refs[-1]
    ni, si = lax.axis_index("n"), lax.axis_index("s")
    if p.cluster > 1:  # CTAs of a cluster take neighbouring N blocks of the same K range
        ni = ni * p.cluster + lax.axis_index("cluster")
    np_ = w_gmem.shape[0]
    r = p.tk // p.kb  # blocks per step along K
    g = group_size
    first = si * p.steps

    def block_spec(shape, dtype, row_block, j, **kw):  # block j of the step along K (x and the weight)
        index = lambda kk: (row_block, (first + kk) * r + j)  # noqa: E731
        return plgpu.BlockSpec(shape, index, transforms=_swizzled(p.kb, dtype), **kw)

    multicast = dict(collective_axes=("cluster",)) if p.cluster > 1 else {}  # one x load feeds the cluster's CTAs
    specs = [block_spec((p.mp, p.kb), compute_dtype, 0, j, **multicast) for j in range(r)]
    specs += [block_spec((p.cta_rows, p.kb), w_gmem.dtype, ni, j) for j in range(r)]
    gmem_in = [x_gmem] * r + [w_gmem] * r
    if fmt == "int4":  # the step's group scales (and zero shifts): [tk / g, 2R] f32
        groups = p.tk // group_size
        specs += [plgpu.BlockSpec((groups, p.cta_rows), lambda kk: (first + kk, ni))] * (1 + has_zeros)
        gmem_in += list(refs[2 : 3 + has_zeros])

    staged = a_via_smem and fmt != "bf16"
    wr = p.wg_rows
    epi = _epi_cols(p.mp)
    scoped = dict(out_smem=plgpu.SMEM((COMPUTE_WGS, wr, epi), jnp.float32))  # [wg, wg_rows, epi], unswizzled
    if staged:  # [wg, R, kb] bf16, swizzled like x's block (wgmma wants equal A and B swizzles)
        scoped["a_staging"] = plgpu.SMEM(
            (COMPUTE_WGS, wr, p.kb), compute_dtype, transforms=_swizzled(p.kb, compute_dtype)
        )

    @functools.partial(pl.run_scoped, **scoped, collective_axes="wg")
    def _scope(out_smem, a_staging=None):
        wg = lax.axis_index("wg")

        def mma_body(_, *args):
            # args: x blocks [Mp, kb] * r, weight blocks [2R, kb] * r, (int4) scales [tk/g, 2R] (+ zshift), acc
            *smem, acc_ref = args
            xs, ws, gs = smem[:r], smem[r : 2 * r], smem[2 * r :]

            def tile(j):  # block j's A operand: [R, kb] codes in SMEM (bf16) or dequantised in registers
                w_rows = ws[j].at[pl.ds(wg * wr, wr)]
                if fmt == "bf16":
                    return w_rows
                return _dequant_tile(w_rows, gs, j, wg, fmt, has_zeros, compute_dtype, g, upcast_load)

            upcoming = tile(0) if overlap else None
            for j in range(r):
                b = xs[j].transpose((1, 0))  # [kb, Mp]
                if a_staging is not None:  # via SMEM: the interpreter's wgmma reads refs only (and a GPU fallback)
                    a_staging[wg] = tile(j)
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, a_staging.at[wg], b)
                elif overlap:  # block j + 1 is dequantised while block j's wgmma runs (its registers stay live)
                    a = upcoming
                    plgpu.wgmma(acc_ref, a, b)
                    upcoming = tile(j + 1) if j + 1 < r else None
                else:
                    plgpu.wgmma(acc_ref, tile(j), b)
                plgpu.wgmma_wait(0)  # A's registers / staging buffer are reused by the next block
            return acc_ref

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wr, p.mp), jnp.float32))
            def _acc_scope(acc_ref):
                eval_pipeline(acc_ref)
                acc = acc_ref[...]  # [wg_rows, Mp] f32
                row = si * np_ + ni * p.cta_rows + wg * wr
                for c in range(p.mp // epi):  # column chunks: a whole [wg_rows, Mp] f32 buffer is 128 KB at Mp 256
                    out_smem[wg] = acc[:, c * epi : (c + 1) * epi]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[pl.ds(row, wr), pl.ds(c * epi, epi)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_smem is rewritten by the next chunk

        plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(p.steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=specs,
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=p.depth,
            compute_context=compute_context,
        )(*gmem_in)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# Layer 2: the kernel call and the XLA epilogue ---------------------------------------------------------------------


def _stream_call(x2, w: StreamWeight, config: StreamConfig, interpret, num_sms: int):
    """x2 [M, K] -> [M, N] in x2's dtype."""
    m = x2.shape[0]
    np_, kp = w.wt.shape
    p = plan(m, w, config, num_sms)
    xp = _pad2(x2, p.mp, kp)  # [Mp, Kp]: zero rows / columns add nothing
    inputs = [xp, w.wt] + ([w.scales] if w.fmt == "int4" else []) + ([w.zshift] if w.zshift is not None else [])
    kernel = functools.partial(
        _kernel,
        p=p,
        fmt=w.fmt,
        group_size=w.group_size,
        has_zeros=w.zshift is not None,
        compute_dtype=x2.dtype,
        a_via_smem=config.a_via_smem or interpret is not None,
        overlap=config.overlap and w.fmt != "bf16",
        upcast_load=config.upcast_load,
    )
    partials = plgpu.kernel(
        kernel,
        out_type=backend_lib.out_struct((p.splits * np_, p.mp), jnp.float32, inputs),
        grid=(p.n_blocks // p.cluster, p.splits),
        grid_names=("n", "s"),
        cluster=(p.cluster,),
        cluster_names=("cluster",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )(*inputs)
    out_t = partials.reshape(p.splits, np_, p.mp).sum(axis=0)[: w.n, :m]  # [N, M] f32
    if w.fmt in ("int8", "fp8"):
        out_t = out_t * w.scales[:, None]
    return out_t.T.astype(x2.dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "num_sms"))
def _stream_jit(x, w, *, config, interpret, num_sms):
    out = _stream_call(x.reshape(-1, x.shape[-1]), w, config, interpret, num_sms)
    return out.reshape(*x.shape[:-1], w.n)


# Layer 3: the validated entry point --------------------------------------------------------------------------------


def smem_bytes(m: int, w: StreamWeight, config: StreamConfig, num_sms: int) -> int:
    """SMEM of one CTA (ring slots after `plan` fitted them, epilogue and staging buffers)."""
    return plan(m, w, config, num_sms).smem


def _validate(x, w: StreamWeight, config: StreamConfig, num_sms: int):
    if not isinstance(w, StreamWeight):
        raise ValueError(f"stream_matmul: w must be a StreamWeight (see prepare()), got {type(w).__name__}")
    if w.fmt not in FORMATS:
        raise ValueError(f"stream_matmul: unknown fmt {w.fmt!r}; expected one of {FORMATS}")
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"stream_matmul: x must be bfloat16 or float16, got {x.dtype}")
    if w.fmt == "bf16" and w.wt.dtype != x.dtype:
        raise ValueError(f"stream_matmul: a plain weight must have x's dtype {x.dtype}, got {w.wt.dtype}")
    if w.fmt != "bf16" and w.wt.dtype != _CODE_DTYPES[w.fmt]:
        raise ValueError(f"stream_matmul: fmt {w.fmt!r} stores {jnp.dtype(_CODE_DTYPES[w.fmt])}, got {w.wt.dtype}")
    if x.ndim < 1 or x.shape[-1] != w.k:
        raise ValueError(f"stream_matmul: x's last axis {x.shape[-1:]} != the weight's K {w.k}")
    rows = math.prod(x.shape[:-1])
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"stream_matmul: takes 1..{MAX_ROWS} rows of x (wgmma N <= 256), got {rows}")
    if config.wg_rows * max(8, -(-rows // 8) * 8) > 128 * 128:
        raise ValueError(f"stream_matmul: wg_rows={config.wg_rows} with {rows} rows of x needs > 128 acc regs a thread")
    need = smem_bytes(rows, w, config, num_sms)
    if need > SMEM_BYTES:
        raise ValueError(
            f"stream_matmul: {config} needs {need} bytes of SMEM > {SMEM_BYTES} even at 2 slots of tile_k 64"
        )


def stream_matmul(x: jax.Array, w: StreamWeight, *, config: StreamConfig | None = None, backend: str | None = None):
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype (f32 accumulation), w from `prepare`.

    Args:
        x: [..., K] bfloat16 or float16, at most MAX_ROWS rows in all.
        w: a StreamWeight.
        config: tiles (StreamConfig()).
        backend: None or "mosaic_gpu" (the Hopper kernel), "interpret" (the Mosaic GPU interpreter, CPU tests) or
            "xla" (`reference` on the dequantised weight).

    Raises:
        ValueError: shapes, dtypes, tiles or the backend do not fit.
    """
    if backend == "triton":
        raise ValueError("stream_matmul: backend 'triton' is pallas_kernels/quantized_matmul.py; use 'mosaic_gpu'")
    backend = backend_lib.resolve_backend(backend or "mosaic_gpu", KERNEL_NAME)
    config = config or StreamConfig()
    if backend == "xla":
        return stream_reference(x, w)
    interpret = plgpu.InterpretGPUParams() if backend == "interpret" else None
    num_sms = INTERPRET_SMS if interpret is not None else _num_sms()
    _validate(x, w, config, num_sms)
    return _stream_jit(x, w, config=config, interpret=interpret, num_sms=num_sms)


# Layer 4: the reference --------------------------------------------------------------------------------------------


def dequantize(w: StreamWeight) -> jax.Array:
    """The logical weight [K, N] in float32 from the stored layout (plain jnp)."""
    wt = w.wt.astype(jnp.float32)  # [Np, Kp]
    if w.fmt == "int4":
        g = w.group_size
        z = 0.0 if w.zshift is None else jnp.repeat(w.zshift.T, g, axis=1)
        wt = (wt - z) * jnp.repeat(w.scales.T, g, axis=1)
    wt = wt[: w.n, : w.k]
    if w.fmt in ("int8", "fp8"):
        wt = wt * w.scales[:, None]
    return wt.T


def stream_reference(x: jax.Array, w: StreamWeight, **_) -> jax.Array:
    """Plain jnp with stream_matmul's signature: dequantise to f32, dot at HIGHEST, cast to x's dtype."""
    out = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), dequantize(w), precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)
