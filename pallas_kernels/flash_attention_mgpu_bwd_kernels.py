"""The kernel bodies of the Hopper FlashAttention backward (Pallas Mosaic GPU); the pallas_call builders, the
config and the entry point are in flash_attention_mgpu_bwd.py.

Each kernel has two compute warpgroups (232 regs) and one TMA warpgroup (40 regs) that streams blocks through an
SMEM ring, refilling a slot once both compute warpgroups consumed it (`_produce_ring`).

  dk/dv kernel (`dkv_kernel`): one CTA per 128 keys of one (batch, kv head); warpgroup w owns keys
      [w*64, w*64 + 64), K_w/V_w in SMEM, dK_w/dV_w [64, D] f32 in registers, and walks every query block that
      sees them, for each of the G query heads of its GQA group in turn (so GQA needs no reduction afterwards):
          sT  = K_w @ Q^T,  dpT = V_w @ dO^T            wgmma, [64 keys, 64 queries] f32
          pT  = exp2(sT * scale * log2e - lse2)         lse2 = lse * log2e from the forward
          dsT = pT * (dpT - delta)                      delta = rowsum(o * do) - dlse (XLA)
          dV_w += pT @ dO,  dK_w += dsT @ Q              wgmma, A from registers
      Fused (`Dims.with_dq`): after dK/dV, both warpgroups put dS^T in SMEM, meet on a barrier, and warpgroup w
      computes dQ[:, w*64 : w*64 + 64] = dS @ K[:, w*64 : w*64 + 64] over all 128 keys, then TMA-reduce-adds it.
  dq kernel (`dq_kernel`): the forward's layout: one CTA per 128 query rows of one (batch, query head), 64 rows
      per compute warpgroup; per key block s = Q K^T, dp = dO V^T, ds = p * (dp - delta), dQ += ds @ K.

    query blocks (dk/dv):  lo ........ full_lo .............. hi      key blocks (dq):  0 ...... full_hi ...... hi
                           [ diagonal / key-tail mask ][ plain ]                        [ plain ][ diagonal / tail ]

Blocks entirely above the diagonal are never visited; query blocks past the real length are skipped; padded
query rows inside a block carry dO = 0 and delta = 0, so they add nothing; padded keys are masked.

In the Mosaic GPU interpreter (`Dims.interpret`, CPU tests) each product stages A through SMEM into a fresh
accumulator (`_mma_add`), because jax 0.11.2's interpreter lacks pl.run_state and wgmma with A in registers.
"""

from __future__ import annotations

import dataclasses
import math

import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
COMPUTE_WGS = 2
BLOCK = 64  # keys per compute warpgroup and queries per step (one wgmma M tile)
KV_PER_CTA = COMPUTE_WGS * BLOCK
BF16_TILES = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class Dims:
    """Static facts of one backward call that the kernel bodies specialise on (built by `backward`)."""

    head_dim: int
    group: int  # query heads per kv head
    steps: int  # ring depth
    num_q_blocks: int  # query blocks holding real rows: cdiv(q_len, 64)
    q_off: int  # static position of query 0 in the key sequence (0 without causal)
    causal: bool
    kv_len: int  # unpadded
    dtype: object
    with_dq: bool = True  # the fused kernel; False: dk/dv only
    interpret: bool = False  # the Mosaic GPU interpreter (CPU tests): accumulate without pl.run_state


def _two_products(shape, first, second):
    """(a @ b for (a, b) in first, second) in f32 registers: two wgmmas into fresh [shape] accumulators
    (the scores S and dP = dO V^T, or their transposes, of one tile)."""

    def body(acc0, acc1):
        plgpu.wgmma(acc0, *first)
        plgpu.wgmma(acc1, *second)
        return acc0[...], acc1[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _produce_ring(issue, total, consumed, d: Dims):
    """TMA producer loop: `issue(t, slot)` loads step t into ring slot `slot`; the first `d.steps` steps fill
    the ring, and every later step waits until the compute warpgroups release its slot on `consumed`."""
    for i in range(d.steps):
        pl.when(i < total)(lambda i=i: issue(jnp.int32(i), i))

    @pl.loop(0, jnp.maximum(total - d.steps, 0))
    def _refill(t):
        slot = lax.rem(t, jnp.array(d.steps, t.dtype))
        plgpu.barrier_wait(consumed.at[slot])
        issue(t + d.steps, slot)

    _drain_consumed(consumed, total, d)


def _drain_consumed(consumed, total, d: Dims):
    """Interpreter only: observe the ring's last `steps` consumed phases, which need no refill.

    The interpreter insists that a thread which waits on a barrier observes every phase before it is freed;
    the hardware does not care, so the GPU kernels skip these waits.
    """
    if not d.interpret:
        return

    @pl.loop(jnp.maximum(total - d.steps, 0), total)
    def _(t):
        plgpu.barrier_wait(consumed.at[lax.rem(t, jnp.array(d.steps, t.dtype))])


def stage_smem(d: Dims, cols: int):
    """Interpreter only: an SMEM tile per compute warpgroup to stage wgmma's A operand ([64, cols])."""
    return plgpu.SMEM((COMPUTE_WGS, BLOCK, cols), d.dtype, transforms=BF16_TILES) if d.interpret else None


def _mma_add(acc, a, b, a_smem):
    """acc + a @ b in the interpreter's terms: A staged through SMEM, a fresh accumulator added in registers.

    (The Mosaic GPU interpreter of jax 0.11.2 has no rule for pl.run_state and reads wgmma's A only from SMEM;
    on a GPU the kernels accumulate in place with A from registers.)
    """
    a_smem[...] = a
    plgpu.commit_smem()

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b)
        return acc_ref[...]

    return acc + pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32))


def block_range(kv_first, d: Dims):
    """Query blocks of one head that see keys [kv_first, kv_first + 128): (lo, full_lo, hi).

    Blocks [lo, full_lo) need a mask (causal diagonal, or padded keys in this CTA); [full_lo, hi) do not.
    """
    hi = d.num_q_blocks
    if d.causal:  # query i (position q_off + i) sees key j iff q_off + i >= j
        lo = jnp.maximum(kv_first - d.q_off, 0) // BLOCK
        full_lo = (jnp.maximum(kv_first + KV_PER_CTA - 1 - d.q_off, 0) + BLOCK - 1) // BLOCK
    else:
        lo = full_lo = jnp.int32(0)
    lo = jnp.minimum(lo, hi)
    full_lo = jnp.where(kv_first + KV_PER_CTA > d.kv_len, hi, jnp.clip(full_lo, lo, hi))
    return lo, full_lo, hi


def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, scoped, *, sm_scale, d: Dims):
    # q_ref, do_ref: [B, Tq_pad, Hq, D] GMEM      k_ref, v_ref, dk_ref, dv_ref: [B, Tk_pad, Hkv, D] GMEM
    # lse_ref (log2 domain), delta_ref: [B, Hq, Tq_pad] f32      dq_ref: [B, Tq_pad, Hq, D] f32 (reduce-add)
    smem, (kv_ready, ready, consumed, ds_ready, k_done) = scoped
    # k_smem, v_smem: [128, D]   q_smem, do_smem: [S, 64, D]   lse_smem, delta_smem: [S, 64] f32
    # ds_smem: [2, 128, 64]   dq_smem: [2, 64, D/2] f32
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, stage = smem
    wg = lax.axis_index("wg")
    kv_first = lax.axis_index("kv_seq") * KV_PER_CTA
    lo, full_lo, hi = block_range(kv_first, d)
    per_head = jnp.maximum(hi - lo, 0)
    rings = (q_smem, do_smem, lse_smem, delta_smem)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        _compute_wg(
            dq_ref,
            dk_ref,
            dv_ref,
            k_smem,
            v_smem,
            rings,
            ds_smem,
            None if dq_smem is None else dq_smem.at[wg],
            None if stage is None else stage.at[wg],
            (kv_ready, ready, consumed, ds_ready, k_done),
            (lo, full_lo, hi, per_head),
            kv_first,
            sm_scale=sm_scale,
            d=d,
        )

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        _memory_wg(
            q_ref,
            k_ref,
            v_ref,
            do_ref,
            lse_ref,
            delta_ref,
            k_smem,
            v_smem,
            rings,
            (kv_ready, ready, consumed),
            (lo, per_head),
            kv_first,
            d,
        )


def _memory_wg(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, k_smem, v_smem, rings, barriers, bounds, kv_first, d: Dims
):
    q_smem, do_smem, lse_smem, delta_smem = rings
    kv_ready, ready, consumed = barriers
    lo, per_head = bounds
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    total = d.group * per_head  # ring steps: (head g, query block lo + i) for g < G, i < per_head
    kv_rows = (batch, pl.ds(kv_first, KV_PER_CTA), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, kv_ready)
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, kv_ready)

    def issue(t, slot):
        head = kv_head * d.group + t // per_head
        rows = pl.ds((lo + t % per_head) * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_smem.at[slot], ready.at[slot])

    _produce_ring(issue, total, consumed, d)


def _compute_wg(
    dq_ref,
    dk_ref,
    dv_ref,
    k_smem,
    v_smem,
    rings,
    ds_smem,
    dq_smem,
    stage,
    barriers,
    bounds,
    kv_first,
    *,
    sm_scale,
    d: Dims,
):
    q_smem, do_smem, lse_smem, delta_smem = rings
    kv_ready, ready, consumed, ds_ready, k_done = barriers
    lo, full_lo, hi, per_head = bounds
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    half = d.head_dim // COMPUTE_WGS
    my_rows = pl.ds(wg * BLOCK, BLOCK)
    k_w, v_w = k_smem.at[my_rows], v_smem.at[my_rows]  # [64, D] each
    k_cols = k_smem.at[:, pl.ds(wg * half, half)]  # [128, D/2]: all CTA keys, this wg's half of dQ's columns
    scale2 = sm_scale * LOG2E
    shape = (BLOCK, BLOCK)

    def step(t, qb, head, carry, masked: bool):
        dk, dv = carry  # [64, D] f32 each
        slot = lax.rem(t, jnp.array(d.steps, t.dtype))
        dslot = lax.rem(t, jnp.array(2, t.dtype))
        q_s, do_s = q_smem.at[slot], do_smem.at[slot]
        plgpu.barrier_wait(ready.at[slot])

        s_t, dp_t = _two_products(shape, (k_w, q_s.transpose((1, 0))), (v_w, do_s.transpose((1, 0))))
        lse2 = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))  # [64] per query column
        delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        s_t = s_t * scale2
        if masked:
            kpos = kv_first + wg * BLOCK + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            seen = kpos < d.kv_len
            if d.causal:
                qpos = d.q_off + qb * BLOCK + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                seen = jnp.logical_and(seen, kpos <= qpos)
            s_t = jnp.where(seen, s_t, -jnp.inf)
        p_t = jnp.exp2(s_t - lax.broadcast_in_dim(lse2, shape, [1]))  # [64 keys, 64 queries]
        ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, shape, [1]))
        p_lo, ds_lo = p_t.astype(d.dtype), ds_t.astype(d.dtype)
        if not d.with_dq:

            def grads(refs):
                dv_ref, dk_ref = refs
                plgpu.wgmma(dv_ref, p_lo, do_s)
                plgpu.wgmma(dk_ref, ds_lo, q_s)

            if d.interpret:
                dv, dk = _mma_add(dv, p_lo, do_s, stage), _mma_add(dk, ds_lo, q_s, stage)
            else:
                dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
            plgpu.barrier_arrive(consumed.at[slot])
            return dk, dv
        ds_smem.at[dslot, my_rows][...] = ds_lo
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_ready.at[dslot])

        def grads_fused(refs):
            dv_ref, dk_ref, dq_part_ref = refs
            plgpu.wgmma(dv_ref, p_lo, do_s)
            plgpu.wgmma(dk_ref, ds_lo, q_s)
            plgpu.barrier_wait(ds_ready.at[dslot])  # the other warpgroup's dS^T rows are in SMEM too
            plgpu.wgmma(dq_part_ref, ds_smem.at[dslot].transpose((1, 0)), k_cols)

        dq0 = plgpu.layout_cast(jnp.zeros((BLOCK, half), jnp.float32), plgpu.Layout.WGMMA)
        dv, dk, dq_part = pl.run_state(grads_fused)((plgpu.ACC.init(dv), plgpu.ACC.init(dk), plgpu.ACC.init(dq0)))
        plgpu.barrier_arrive(consumed.at[slot])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduction has read dq_smem
        dq_smem[...] = dq_part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            dq_smem, dq_ref.at[batch, pl.ds(qb * BLOCK, BLOCK), head, pl.ds(wg * half, half)], reduction_op="add"
        )
        return dk, dv

    def one_head(g, carry):
        head = kv_head * d.group + g
        base = g * per_head - lo  # ring step of query block qb is base + qb
        carry = lax.fori_loop(lo, full_lo, lambda qb, c: step(base + qb, qb, head, c, masked=True), carry)
        return lax.fori_loop(full_lo, hi, lambda qb, c: step(base + qb, qb, head, c, masked=False), carry)

    zeros = plgpu.layout_cast(jnp.zeros((BLOCK, d.head_dim), jnp.float32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(kv_ready)
    dk, dv = lax.fori_loop(0, d.group, one_head, (zeros, zeros))
    if d.with_dq:
        plgpu.barrier_arrive(k_done)
        plgpu.barrier_wait(k_done)  # the other warpgroup's last dQ wgmma has read all of K
    k_w[...] = (dk * sm_scale).astype(d.dtype)
    v_w[...] = dv.astype(d.dtype)
    plgpu.commit_smem()
    out_rows = (batch, pl.ds(kv_first + wg * BLOCK, BLOCK), kv_head)
    plgpu.copy_smem_to_gmem(k_w, dk_ref.at[out_rows], commit_group=False)
    plgpu.copy_smem_to_gmem(v_w, dv_ref.at[out_rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------------------------------------
# dq kernel (the unfused path): the forward's structure, with dq = sum over key blocks of dS @ K.
# ---------------------------------------------------------------------------------------------------------


def dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    scoped,
    *,
    sm_scale,
    block_kv: int,
    num_q_tiles: int,
    d: Dims,
):
    # q_ref, do_ref, dq_ref: [B, Tq_pad, Hq, D] GMEM    k_ref, v_ref: [B, Tk_pad, Hkv, D] GMEM
    # lse_ref (log2 domain), delta_ref: [B, Hq, Tq_pad] f32
    smem, (q_ready, kv_ready, consumed) = scoped
    q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem, stage = smem
    wg = lax.axis_index("wg")
    q_tile = lax.axis_index("q_seq")
    if d.causal:  # heaviest query tiles first, so the tail of the grid is short
        q_tile = num_q_tiles - 1 - q_tile
    cta_first = q_tile * KV_PER_CTA
    real_blocks = -(-d.kv_len // block_kv)
    if d.causal:  # key blocks up to the CTA's last query position; unmasked up to its first
        hi = jnp.minimum((d.q_off + cta_first + KV_PER_CTA - 1) // block_kv + 1, real_blocks)
        full_hi = (d.q_off + cta_first + 1) // block_kv
    else:
        hi = real_blocks
        full_hi = jnp.int32(d.kv_len // block_kv)
    full_hi = jnp.minimum(full_hi, d.kv_len // block_kv)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        own = (q_smem2.at[wg], do_smem2.at[wg], lse_smem2.at[wg], delta_smem2.at[wg])
        _dq_compute_wg(
            q_ref,
            do_ref,
            lse_ref,
            delta_ref,
            dq_ref,
            own,
            None if stage is None else stage.at[wg],
            k_smem,
            v_smem,
            (q_ready.at[wg], kv_ready, consumed),
            (full_hi, hi),
            cta_first + wg * BLOCK,
            sm_scale=sm_scale,
            block_kv=block_kv,
            d=d,
        )

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        batch = lax.axis_index("batch")
        kv_head = lax.div(lax.axis_index("heads"), jnp.array(d.group, jnp.int32))

        def issue(t, slot):
            rows = (batch, pl.ds(t * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], kv_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], kv_ready.at[slot])

        _produce_ring(issue, hi, consumed, d)  # d.steps <= the key blocks: the prologue stays in bounds


def _dq_compute_wg(
    q_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    own,
    stage,
    k_smem,
    v_smem,
    barriers,
    bounds,
    q_base,
    *,
    sm_scale,
    block_kv: int,
    d: Dims,
):
    q_smem, do_smem, lse_smem, delta_smem = own  # [64, D], [64, D], [64] f32, [64] f32
    q_ready, kv_ready, consumed = barriers
    full_hi, hi = bounds
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    rows = pl.ds(q_base, BLOCK)
    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem, q_ready)
    plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem, q_ready)
    plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem, q_ready)
    plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_smem, q_ready)
    plgpu.barrier_wait(q_ready)
    lse2 = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [64] per query row
    delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    scale2 = sm_scale * LOG2E
    shape = (BLOCK, block_kv)

    def step(t, dq, masked: bool):  # dq: [64, D] f32
        slot = lax.rem(t, jnp.array(d.steps, t.dtype))
        k_s, v_s = k_smem.at[slot], v_smem.at[slot]
        plgpu.barrier_wait(kv_ready.at[slot])

        s, dp = _two_products(shape, (q_smem, k_s.transpose((1, 0))), (do_smem, v_s.transpose((1, 0))))
        s = s * scale2
        if masked:
            kpos = t * block_kv + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            seen = kpos < d.kv_len
            if d.causal:
                qpos = d.q_off + q_base + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                seen = jnp.logical_and(seen, kpos <= qpos)
            s = jnp.where(seen, s, -jnp.inf)
        p = jnp.exp2(s - lax.broadcast_in_dim(lse2, shape, [0]))
        ds = (p * (dp - lax.broadcast_in_dim(delta, shape, [0]))).astype(d.dtype)

        def acc_dq(dq_ref_):
            plgpu.wgmma(dq_ref_, ds, k_s)

        dq = _mma_add(dq, ds, k_s, stage) if d.interpret else pl.run_state(acc_dq)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(consumed.at[slot])
        return dq

    dq = plgpu.layout_cast(jnp.zeros((BLOCK, d.head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dq = lax.fori_loop(0, full_hi, lambda t, c: step(t, c, masked=False), dq)
    dq = lax.fori_loop(full_hi, hi, lambda t, c: step(t, c, masked=True), dq)
    q_smem[...] = (dq * sm_scale).astype(d.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)
