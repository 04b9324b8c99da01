"""Hopper FlashAttention forward through Pallas Mosaic GPU (wgmma + TMA + warp specialisation).

One CTA owns 2 * block_q query rows of one (batch, query head) and runs three warpgroups:

    wg 0, 1  (compute, 232 regs): q tile [block_q, D] in SMEM; per KV step s = q @ k.T (wgmma into registers),
             online softmax in the log2 domain, acc += p @ v (wgmma, p from registers).
             A shared "schedule" barrier makes the two compute warpgroups alternate on the tensor cores
             (one runs its softmax while the other's matmuls issue: FlashAttention-3's ping-pong).
    wg 2     (memory, 40 regs): TMA-loads K and V blocks into a ring of `max_concurrent_steps` SMEM slots,
             refilling a slot once both compute warpgroups have arrived on its "consumed" barrier.

    KV step:  0 ...... full_steps ........ kv_steps ........ cta_steps
              [ unmasked ][ causal / tail mask ][ drain: arrive only ]

Causal CTAs near the end of the sequence do the most work, so the grid walks query tiles in reverse.
The wrapper (flash_attention.py) pads Tq to 2 * block_q and Tk to block_kv; padded keys are masked here and
padded query rows are sliced off there. Sliding windows, segment ids, soft caps and traced q offsets use the
Triton kernel instead (`supports()`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU forward: rows per compute warpgroup, keys per step, SMEM ring depth."""

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2

    def __post_init__(self):
        if self.block_q % 64 or self.block_kv % 64:
            raise ValueError(f"block_q and block_kv must be multiples of 64, got {self}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> "MgpuConfig":
        return cls(block_kv=64) if head_dim > 128 else cls()


def supports(q_dtype, head_dim: int, st) -> bool:
    """Whether the Mosaic GPU forward handles this call (`st` is flash_attention_common.KernelStatic)."""
    return (jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 64 == 0
            and head_dim <= 256 and st.sliding_window is None and not st.has_segments
            and st.logits_soft_cap is None and st.static_q_offset is not None)


def tile_multiples(head_dim: int) -> tuple[int, int]:
    """(query, key) lengths must be padded to multiples of these for `forward`."""
    cfg = MgpuConfig.for_head_dim(head_dim)
    return COMPUTE_WGS * cfg.block_q, cfg.block_kv


def forward(q, k, v, st, cfg: MgpuConfig | None = None, interpret=None):
    """o [B, Tq_pad, Hq, D] and lse [B, Hq, Tq_pad] (natural log) from padded q [B, Tq_pad, Hq, D], k/v."""
    batch, tq_pad, hq, head_dim = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    cfg = cfg or MgpuConfig.for_head_dim(head_dim)
    if tq_pad % (COMPUTE_WGS * cfg.block_q) or tk_pad % cfg.block_kv:
        raise ValueError(f"padded lengths {tq_pad}, {tk_pad} do not fit tiles {cfg}")
    num_q_tiles = tq_pad // (COMPUTE_WGS * cfg.block_q)
    num_kv_blocks = tk_pad // cfg.block_kv
    steps = min(cfg.max_concurrent_steps, num_kv_blocks)
    dims = _Dims(block_q=cfg.block_q, block_kv=cfg.block_kv, head_dim=head_dim, group=hq // hkv, steps=steps,
                 num_q_tiles=num_q_tiles, num_kv_blocks=num_kv_blocks, dtype=q.dtype)

    def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, st=st, d=dims),
            (plgpu.SMEM((COMPUTE_WGS, cfg.block_q, head_dim), q.dtype, transforms=transforms),  # q, then o
             plgpu.SMEM((steps, cfg.block_kv, head_dim), q.dtype, transforms=transforms),  # k ring
             plgpu.SMEM((steps, cfg.block_kv, head_dim), q.dtype, transforms=transforms),  # v ring
             plgpu.SMEM((COMPUTE_WGS, cfg.block_q), jnp.float32)),  # lse staging
            (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
             plgpu.Barrier(num_barriers=COMPUTE_WGS)),  # k ready, v ready, q ready
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),) * 2,  # k consumed, v consumed
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # tensor-core schedule (ping-pong)
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, hq, tq_pad), jnp.float32)),
        grid=(hq, num_q_tiles, batch),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


@dataclasses.dataclass(frozen=True)
class _Dims:
    block_q: int
    block_kv: int
    head_dim: int
    group: int
    steps: int  # SMEM ring depth
    num_q_tiles: int
    num_kv_blocks: int
    dtype: object


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, st, d: _Dims):
    # q_ref, o_ref: [B, Tq_pad, Hq, D] GMEM     k_ref, v_ref: [B, Tk_pad, Hkv, D] GMEM
    # lse_ref: [B, Hq, Tq_pad] f32 GMEM
    smem, ready, consumed, schedule = scoped
    qo_smem2, k_smem, v_smem, lse_smem2 = smem  # [2, bq, D], [steps, bkv, D] x2, [2, bq] f32
    k_ready, v_ready, q_ready = ready
    k_consumed, v_consumed = consumed
    wg = lax.axis_index("wg")
    q_tile = d.num_q_tiles - 1 - lax.axis_index("q_seq") if st.causal else lax.axis_index("q_seq")
    cta_q_base = q_tile * (COMPUTE_WGS * d.block_q)
    if st.causal:  # last key the CTA's last row can see, relative to the padded kv blocks
        cta_last = st.static_q_offset + cta_q_base + COMPUTE_WGS * d.block_q - 1
        cta_steps = jnp.minimum(cta_last // d.block_kv + 1, d.num_kv_blocks)
    else:
        cta_steps = d.num_kv_blocks  # a Python int: constants captured by wgmma closures must stay static

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        _compute_wg(q_ref, o_ref, lse_ref, qo_smem2.at[wg], lse_smem2.at[wg], k_smem, v_smem,
                    (k_ready, v_ready, q_ready.at[wg]), (k_consumed, v_consumed), schedule,
                    q_base=cta_q_base + wg * d.block_q, cta_steps=cta_steps, st=st, d=d)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        _memory_wg(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed, cta_steps, d)


def _memory_wg(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed, cta_steps, d: _Dims):
    batch = lax.axis_index("batch")
    kv_head = lax.div(lax.axis_index("heads"), jnp.array(d.group, jnp.int32))

    def issue(step, slot):
        rows = (batch, pl.ds(step * d.block_kv, d.block_kv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

    for i in range(d.steps):  # prologue: fill the ring (cta_steps >= 1 always, but guard the rest)
        pl.when(i < cta_steps)(lambda i=i: issue(i, i))

    @pl.loop(0, _max(cta_steps - d.steps, 0))
    def _refill(step):
        slot = lax.rem(step, jnp.array(d.steps, step.dtype))
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])
        issue(step + d.steps, slot)


def _compute_wg(q_ref, o_ref, lse_ref, qo_smem, lse_smem, k_smem, v_smem, ready, consumed, schedule, *,
                q_base, cta_steps, st, d: _Dims):
    k_ready, v_ready, q_ready = ready
    k_consumed, v_consumed = consumed
    batch, q_head = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    scale2 = st.sm_scale * LOG2E

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, d.block_q), q_head], qo_smem, q_ready)
    plgpu.barrier_wait(q_ready)
    first_pos = st.static_q_offset + q_base  # key position of this warpgroup's first query row
    if st.causal:
        kv_steps = jnp.minimum((first_pos + d.block_q - 1) // d.block_kv + 1, d.num_kv_blocks)
        full_steps = (first_pos + 1) // d.block_kv
    else:
        kv_steps = full_steps = d.num_kv_blocks
    full_steps = _min(full_steps, st.kv_len // d.block_kv)  # the padded tail block needs a mask

    def kv_step(step, carry, masked: bool):
        acc, m_i, l_i = carry  # [bq, D] f32, [bq] f32 (log2 domain, scaled), [bq] f32
        slot = lax.rem(step, jnp.array(d.steps, step.dtype))

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
            schedule_barrier()
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((d.block_q, d.block_kv), jnp.float32))  # [bq, bkv]
        plgpu.barrier_arrive(k_consumed.at[slot])
        if masked:
            rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            kpos = cols + step * d.block_kv
            visible = kpos < st.kv_len
            if st.causal:
                visible = jnp.logical_and(visible, kpos <= rows + first_pos)
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1) * scale2)
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i *= alpha
        p_lo = p.astype(d.dtype)
        if d.head_dim <= 128:
            l_i += p.sum(axis=1)
            acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))
        plgpu.barrier_arrive(schedule)  # softmax done: let the other warpgroup's matmul go
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(schedule)
        if d.head_dim > 128:
            l_i += p.sum(axis=1)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])
            nxt = step + 1

            @pl.when(nxt < kv_steps)
            def _():
                plgpu.barrier_wait(k_ready.at[lax.rem(nxt, jnp.array(d.steps, nxt.dtype))])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_new, l_i

    def drain(step, _):  # keep the memory warpgroup's ring moving for steps only the other warpgroup needs
        slot = lax.rem(step, jnp.array(d.steps, step.dtype))
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])
        schedule_barrier()
        schedule_barrier()

    acc = plgpu.layout_cast(jnp.zeros((d.block_q, d.head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((d.block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((d.block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    plgpu.barrier_wait(k_ready.at[0])
    pl.when(wg == 1)(schedule_barrier)
    carry = lax.fori_loop(0, full_steps, lambda i, c: kv_step(i, c, masked=False), (acc, m_i, l_i))
    acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, lambda i, c: kv_step(i, c, masked=True), carry)
    lax.fori_loop(kv_steps, cta_steps, drain, None)
    pl.when(wg == 0)(schedule_barrier)

    acc *= lax.broadcast_in_dim(1.0 / l_i, acc.shape, [0])
    qo_smem[...] = acc.astype(d.dtype)
    lse_smem[...] = (m_i + jnp.log2(l_i)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[batch, pl.ds(q_base, d.block_q), q_head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_base, d.block_q)])
    plgpu.wait_smem_to_gmem(0)
