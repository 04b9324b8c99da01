"""Grouped (ragged) matmul for MoE experts on Hopper, through Pallas Mosaic GPU (wgmma + TMA + warp specialisation).

    out[r] = lhs[r] @ rhs[g(r)]   where the rows of lhs [M, K] are sorted by group and group g holds the
                                  group_sizes[g] consecutive rows after those of groups 0..g-1.

Rows past sum(group_sizes) come out zero, as in `jax.lax.ragged_dot` (the reference).

Work list (built in jnp by `_tile_metadata`, outside the kernel). Row blocks are aligned to `tile_m`; a block that
holds the end of one group and the start of the next is computed once per group, each time storing only its own
rows. Rows past the last group form a pseudo-group G whose tiles are stored as zeros without a K loop:

    rows      0 ........ 96 ...... 128 ........ 256 ...... 300      (tile_m = 128, group_sizes = [96, 204])
    blocks    [     block 0          ][     block 1         ][ block 2 ...
    tiles     t0: block 0, g0, rows [0, 96)
              t1: block 0, g1, rows [96, 128)
              t2: block 1, g1, rows [128, 256)
              t3: block 2, g1, rows [256, 300)

At most cdiv(M, tile_m) + G tiles exist; the kernel loops over the real count only (a dynamic persistent grid).

One CTA per SM runs three warpgroups over its share of (tile, N-block) work items:

    wg 0, 1  (compute): acc [tile_m, tile_n] += A [tile_m, tile_k] @ B [tile_k, tile_n] over K (wgmma, f32), where
             the two warpgroups take the two tile_n halves of the CTA's 2 * tile_n columns; then the epilogue.
    wg 2     (memory): TMA-loads A (rows of lhs) and B (rhs[g]) into a ring of `max_concurrent_steps` SMEM slots.

Epilogue: acc goes to an unswizzled SMEM buffer in `epi_n`-column chunks, then to GMEM with TMA. A TMA box has a
static shape but a tile's row count is dynamic, so the valid rows are written as a ladder of power-of-two boxes
(tile_m, tile_m/2, ..., 1 rows; the bits of the row count), each predicated on its bit: a full tile is one store.

Interpreter (CPU tests, `interpret=plgpu.InterpretGPUParams()`): jax 0.11.2's Mosaic GPU interpreter runs this
kernel unchanged (TMA ring, barriers, dynamic grid, ladder stores).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend as backend_lib

COMPUTE_WGS = 2
MEMORY_REGISTERS = 40
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on Hopper
ROW_ALIGN = 8  # rows of lhs per swizzled SMEM tile row group
INTERPRET_SMS = 3  # "SMs" of the persistent grid in the interpreter: a few, so that the work list is split


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tiles of the grouped matmul: a CTA computes [tile_m, 2 * tile_n] of the output per work item.

    Attributes:
        tile_m: rows per tile (64 or 128; smaller wastes less at group boundaries, larger reuses B more).
        tile_n: columns per compute warpgroup (multiple of 64); N must be a multiple of 2 * tile_n.
        tile_k: depth of one pipeline step (multiple of 64); K must be a multiple of it.
        max_concurrent_steps: SMEM ring depth of the memory warpgroup.
        epi_n: columns per epilogue chunk (divides tile_n).
        delay_release: 1 keeps one wgmma in flight across steps (a slot is released one step later).
        grid_minor_m: the persistent loop walks M fastest (True) or N fastest, in strips of `grid_tile_width`.
        grid_tile_width: strip width of that walk (L2 reuse of A and B between CTAs running together).

    The defaults were the fastest, or within 2% of it, of the six configs swept on the H200
    (benchmarks/results/grouped_matmul_2026-12-01.json, BENCHMARKS.md).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    epi_n: int = 64
    delay_release: int = 1
    grid_minor_m: bool = True
    grid_tile_width: int = 8

    def __post_init__(self):
        if self.tile_m not in (64, 128):
            raise ValueError(f"GroupedMatmulConfig.tile_m must be 64 or 128, got {self.tile_m}")
        if self.tile_n % 64 or self.tile_n <= 0 or self.tile_k % 64 or self.tile_k <= 0:
            raise ValueError(f"GroupedMatmulConfig.tile_n and tile_k must be positive multiples of 64, got {self}")
        if self.epi_n % 64 or self.tile_n % self.epi_n:
            raise ValueError(f"GroupedMatmulConfig.epi_n must be a multiple of 64 dividing tile_n, got {self}")
        if self.delay_release not in (0, 1):
            raise ValueError(f"GroupedMatmulConfig.delay_release must be 0 or 1, got {self.delay_release}")
        if self.max_concurrent_steps <= self.delay_release or self.max_concurrent_steps < 2:
            raise ValueError(f"GroupedMatmulConfig.max_concurrent_steps must be >= 2 and > delay_release, got {self}")
        if self.grid_tile_width < 1:
            raise ValueError(f"GroupedMatmulConfig.grid_tile_width must be >= 1, got {self.grid_tile_width}")
        if self.smem_bytes(2) > SMEM_BYTES:
            raise ValueError(f"GroupedMatmulConfig {self} needs {self.smem_bytes(2)} bytes of SMEM > {SMEM_BYTES}")

    def smem_bytes(self, itemsize: int) -> int:
        ring = self.max_concurrent_steps * (self.tile_m + COMPUTE_WGS * self.tile_n) * self.tile_k
        return itemsize * (ring + COMPUTE_WGS * self.tile_m * self.epi_n)

    @classmethod
    def for_shape(cls, n: int) -> GroupedMatmulConfig:
        """The default tiles for an output width n: the widest tile_n (128 or 64) with n % (2 * tile_n) == 0."""
        return cls() if n % (COMPUTE_WGS * 128) == 0 else cls(tile_n=64)


def supports(dtype, k: int, n: int) -> bool:
    """Whether the Mosaic GPU kernel takes lhs [M, k] @ rhs [G, k, n] of `dtype` with its default tiles."""
    cfg = GroupedMatmulConfig.for_shape(n)
    is_16bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return is_16bit and k % cfg.tile_k == 0 and n % (COMPUTE_WGS * cfg.tile_n) == 0


# Layer 1: the kernel -----------------------------------------------------------------------------------------------


def _kernel(num_tiles_gmem, meta_gmem, lhs_gmem, rhs_gmem, out_gmem, *, cfg: GroupedMatmulConfig, num_groups: int):
    # num_tiles_gmem: [1] int32, number of valid work-list tiles
    # meta_gmem:      [4, T_max] int32, per tile: row block, group (G = zero tile), first row in block, row count
    # lhs_gmem:       [M, K] bf16/f16, rows sorted by group
    # rhs_gmem:       [G, K, N]
    # out_gmem:       [M, N]
    n = out_gmem.shape[1]
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_n = COMPUTE_WGS * tn
    grid_n = n // cta_n
    pipeline = functools.partial(k_pipeline, cfg, lhs_gmem.shape[1], lhs_gmem.dtype)

    def ignore(*_, **__):
        return None

    zero = jnp.int32(0)
    allocs = pipeline(ignore, ignore, zero, zero).get_allocations(lhs_gmem, rhs_gmem.at[0])

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=allocs,
        out_smem=plgpu.SMEM((COMPUTE_WGS, tm, cfg.epi_n), out_gmem.dtype),  # [wg, tile_m, epi_n], unswizzled
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")
        grid_m = num_tiles_gmem[0]

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _work_item(loop_info: plgpu.NDLoopInfo):
            (lin,) = loop_info.index
            mi, ni = plgpu.planar_snake(lin, (grid_m, grid_n), 0 if cfg.grid_minor_m else 1, cfg.grid_tile_width)
            block, group, lo, size = (meta_gmem[f, mi] for f in range(4))
            wg_col = ni * cta_n + wg * tn
            store = functools.partial(store_rows, out_smem.at[wg], out_gmem, cfg, block * tm, lo, size, wg_col)

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    store(acc_ref[...].astype(out_gmem.dtype))

            def mma_body(_, a_smem, b_smem, acc_ref):
                # a_smem: [tile_m, tile_k], b_smem: [tile_k, 2 * tile_n]; this warpgroup's half of the columns.
                plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, pl.ds(wg * tn, tn)])
                plgpu.wgmma_wait(cfg.delay_release)
                return acc_ref

            @pl.when(group < num_groups)
            def _matmul():
                pipeline(mma_body, compute_context, block, ni)(
                    lhs_gmem, rhs_gmem.at[group], allocations=pipeline_allocs
                )

            @pl.when((group == num_groups) & (wg < COMPUTE_WGS))
            def _zeros():
                store(jnp.zeros((tm, tn), out_gmem.dtype))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def k_pipeline(cfg, k, dtype, body, compute_context, block, col_block, *, b_k_major: bool = False, b_collective=()):
    """The warp-specialised K loop of one work item: A = lhs rows of `block`, B = columns `col_block` of rhs[g].

    `b_k_major`: B arrives as [N, K] (K contiguous) and its ring slots are [2 * tile_n, tile_k]; 8-bit wgmma
    (fp8, int8) takes only K-major operands (pallas_kernels/w8a8_matmul.py, which shares this builder).
    `b_collective`: cluster axes over which the CTAs load the same B tile once, multicast (w8a8's cluster_m = 2).
    """
    swizzle = plgpu.find_swizzle(cfg.tile_k * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    a_spec = plgpu.BlockSpec(
        (cfg.tile_m, cfg.tile_k), lambda kk: (block, kk), transforms=transforms, delay_release=cfg.delay_release
    )
    b_block = (cfg.tile_k, COMPUTE_WGS * cfg.tile_n)
    b_spec = plgpu.BlockSpec(
        b_block[::-1] if b_k_major else b_block,
        (lambda kk: (col_block, kk)) if b_k_major else (lambda kk: (kk, col_block)),
        transforms=transforms,
        delay_release=cfg.delay_release,
        collective_axes=b_collective,
    )
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k // cfg.tile_k,),
        memory_registers=MEMORY_REGISTERS,
        in_specs=[a_spec, b_spec],
        wg_axis="wg",
        num_compute_wgs=COMPUTE_WGS,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )


def one_step_safe(cfg, k: int):
    """cfg, with delay_release 0 when the K loop has a single step. jax 0.11.2's warp-specialised pipeline then
    never arrives on the delayed slot's consumed barrier within a work item, and over several work items per SM
    its phases run ahead of the compute warpgroups (the interpreter's barrier checker reports the missed phase;
    on a GPU that is a hang or a ring slot overwritten while wgmma reads it). Same results, one step less overlap."""
    if cfg.delay_release and k // cfg.tile_k < 2:
        return dataclasses.replace(cfg, delay_release=0)
    return cfg


def store_rows(out_smem, out_gmem, cfg, row0, lo, size, col0, tile):
    """Writes rows [lo, lo + size) of `tile` [tile_m, tile_n] (registers) to out_gmem[row0 + lo:, col0:]."""
    # out_smem: [tile_m, epi_n] this warpgroup's staging buffer; tile: [tile_m, tile_n] in registers
    for c in range(cfg.tile_n // cfg.epi_n):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's stores have read out_smem
        out_smem[...] = tile[:, c * cfg.epi_n : (c + 1) * cfg.epi_n]
        plgpu.commit_smem()
        start = lo
        rows = cfg.tile_m
        while rows >= 1:  # one TMA box per set bit of `size` (pl.when: the interpreter has no copy predicate)
            _store_box(out_smem, out_gmem, start, rows, row0, col0 + c * cfg.epi_n, (size & rows) != 0)
            start = start + (size & rows)
            rows //= 2


def _store_box(out_smem, out_gmem, start, rows, row0, col, pred):
    # out_smem: [tile_m, epi_n]; writes its rows [start, start + rows) (static `rows`) to out_gmem[row0 + start:, col:]
    @pl.when(pred)
    def _():
        plgpu.copy_smem_to_gmem(
            out_smem.at[pl.ds(start, rows)],
            out_gmem.at[pl.ds(row0 + start, rows), pl.ds(col, out_smem.shape[1])],
        )


# Layer 2: the pallas_call builder ----------------------------------------------------------------------------------


def _tile_metadata(group_sizes, m: int, tile_m: int):
    """The work list: (num_tiles [1], meta [4, T_max]) with meta rows block, group, first row in block, rows."""
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m).astype(jnp.int32)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # pseudo-group G: rows past the last group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // tile_m
    count = jnp.where(ends > starts, (ends - 1) // tile_m - first + 1, 0)
    cum = jnp.cumsum(count)
    t_max = pl.cdiv(m, tile_m) + num_groups
    t = jnp.arange(t_max, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, t, side="right"), num_groups).astype(jnp.int32)
    block = first[group] + t - (cum - count)[group]
    row_lo = jnp.maximum(starts[group], block * tile_m)
    row_hi = jnp.minimum(ends[group], block * tile_m + tile_m)
    valid = t < cum[-1]
    meta = jnp.stack(
        [
            jnp.where(valid, block, 0),
            jnp.where(valid, group, num_groups),
            jnp.where(valid, row_lo - block * tile_m, 0),
            jnp.where(valid, row_hi - row_lo, 0),
        ]
    ).astype(jnp.int32)
    return cum[-1:].astype(jnp.int32), meta


def _grouped_matmul_call(lhs, rhs, group_sizes, cfg: GroupedMatmulConfig, interpret, num_sms: int):
    m = lhs.shape[0]
    num_groups, _, n = rhs.shape
    num_tiles, meta = _tile_metadata(group_sizes, m, cfg.tile_m)
    if m % ROW_ALIGN:  # TMA loads of the swizzled A tiles need M % 8 == 0; the padded rows are never stored
        lhs = jnp.pad(lhs, ((0, ROW_ALIGN - m % ROW_ALIGN), (0, 0)))
    call = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, num_groups=num_groups),
        out_type=backend_lib.out_struct((m, n), lhs.dtype, [lhs, rhs]),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    return call(num_tiles, meta, lhs, rhs)


# Layer 3: the validated, jitted entry point ------------------------------------------------------------------------


def num_sms() -> int:
    """SMs of the default device: the persistent grid's size (shared with w8a8_matmul)."""
    return int(getattr(jax.devices()[0], "core_count", 132) or 132)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "num_sms"))
def _grouped_matmul_jit(lhs, rhs, group_sizes, *, config, interpret, num_sms):
    return _grouped_matmul_call(lhs, rhs, group_sizes, config, interpret, num_sms)


def _validate(lhs, rhs, group_sizes, cfg: GroupedMatmulConfig):
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"grouped_matmul: expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs.shape}, {rhs.shape}, "
            f"{group_sizes.shape}"
        )
    (m, k), (g, k2, n) = lhs.shape, rhs.shape
    if k != k2:
        raise ValueError(f"grouped_matmul: lhs K={k} does not match rhs K={k2}")
    if group_sizes.shape[0] != g or g == 0:
        raise ValueError(f"grouped_matmul: group_sizes has {group_sizes.shape[0]} entries for G={g} groups (G >= 1)")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integers, got {group_sizes.dtype}")
    if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"grouped_matmul: lhs and rhs must both be bfloat16 or float16, got {lhs.dtype}, {rhs.dtype}")
    if k % cfg.tile_k:
        raise ValueError(f"grouped_matmul: K={k} is not a multiple of config.tile_k={cfg.tile_k}")
    if n % (COMPUTE_WGS * cfg.tile_n):
        raise ValueError(f"grouped_matmul: N={n} is not a multiple of 2 * config.tile_n={COMPUTE_WGS * cfg.tile_n}")
    del m


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    config: GroupedMatmulConfig | None = None,
    backend: str | None = None,
) -> jax.Array:
    """out [M, N] with out[r] = lhs[r] @ rhs[g] for the rows r of group g (rows sorted by group).

    Args:
        lhs: [M, K] bfloat16 or float16, rows sorted by group.
        rhs: [G, K, N], same dtype as lhs.
        group_sizes: [G] integer rows per group; rows past their sum come out zero.
        config: tiles; default `GroupedMatmulConfig.for_shape(N)`.
        backend: None (Mosaic GPU on Hopper, else the XLA reference), "mosaic_gpu", "interpret" (the Mosaic GPU
            interpreter, for CPU tests) or "xla" (`reference`). There is no Triton grouped matmul.

    Returns:
        [M, N] in lhs.dtype (f32 accumulation).

    Raises:
        ValueError: shapes or dtypes that do not match, K or N not a multiple of the tiles, or an unusable backend.
    """
    if backend == "triton":
        raise ValueError("grouped_matmul: backend 'triton' is not implemented; use 'mosaic_gpu', 'interpret' or 'xla'")
    if backend is None:
        backend = "mosaic_gpu" if backend_lib.device_supports("mosaic_gpu") else "xla"
    backend = backend_lib.resolve_backend(backend, "grouped_matmul")
    if backend == "xla":
        return reference(lhs, rhs, group_sizes)
    cfg = config or GroupedMatmulConfig.for_shape(rhs.shape[-1])
    _validate(lhs, rhs, group_sizes, cfg)
    cfg = one_step_safe(cfg, lhs.shape[1])
    if lhs.shape[0] == 0:
        return jnp.zeros((0, rhs.shape[-1]), lhs.dtype)
    interpret = plgpu.InterpretGPUParams() if backend == "interpret" else None
    sms = INTERPRET_SMS if interpret is not None else num_sms()
    return _grouped_matmul_jit(lhs, rhs, group_sizes.astype(jnp.int32), config=cfg, interpret=interpret, num_sms=sms)


# Layer 4: the reference --------------------------------------------------------------------------------------------


def reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, **_) -> jax.Array:
    """`jax.lax.ragged_dot` with f32 accumulation, in lhs.dtype (same signature as `grouped_matmul`)."""
    out = lax.ragged_dot(
        lhs, rhs, group_sizes.astype(jnp.int32), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return out.astype(lhs.dtype)
