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

With `MgpuConfig.pipelined` (the non-causal D=128 default) a compute warpgroup also overlaps with itself, as in
FA3: step i issues q @ k_i.T and p_{i-1} @ v_{i-1} together, waits only for the first and runs softmax(s_i)
while the second is on the tensor cores; acc stays in one wgmma accumulator, rescaled in place.

Causal CTAs near the end of the sequence do the most work, so the grid walks query tiles in reverse.
The wrapper (flash_attention.py) pads Tq to 2 * block_q and Tk to block_kv; padded keys are masked here and
padded query rows are sliced off there. Sliding windows, segment ids, soft caps and traced q offsets use the
Triton kernel instead (`supports()`).

Interpreter (CPU tests, `interpret=plgpu.InterpretGPUParams()` or under `plgpu.force_gpu_interpret_mode()`):
jax 0.11.2's Mosaic GPU interpreter runs everything here except the p @ v product, which it cannot express:
  - `pl.run_state(f)(plgpu.ACC.init(x))` has no interpreter rule (jaxpr_interpret.py leaves run_state_p to a
    plain bind: "TODO(jburnim): Handle run_state_p"), so lowering its body fails with "Cannot lower jaxpr with
    effects: {_WGMMAPipelineEffect, MemoryEffect, IOEffect}" (a 64x64 wgmma of two SMEM refs inside
    run_state reproduces it: "MLIR translation rule for primitive 'wgmma' not found for platform cpu");
  - `plgpu.wgmma(acc, a, b)` with `a` in registers is read as an SMEM allocation key ("Expected shape (6,)
    but got (64, 64)"), and `acc_ref[...] = x` on an accumulator fails the same way.
Both are what FA3 needs on the GPU (p stays in registers; acc is scaled and re-fed without a copy), so the
interpreted kernel computes that one product as `acc += jnp.dot(p, v_smem[slot])` and everything else (TMA
ring, barriers, ping-pong schedule, masks, drain, epilogue) is the GPU code. The interpreter also checks that
every warpgroup using a barrier waits on every phase of it, so the memory warpgroup waits for the last
releases and a draining compute warpgroup waits for the loads it skips (both idle time on the GPU).
"""

from __future__ import annotations

import dataclasses
import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # no public getter for the forced interpret mode in jax 0.11.2

from pallas_kernels.backend import out_struct

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU forward: rows per compute warpgroup, keys per step, SMEM ring depth."""

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    compute_registers: int = 232  # per thread of a compute warpgroup; 240 leaves the memory warpgroup 24
    pipelined: bool = False  # overlap softmax(i) with p_{i-1} @ v_{i-1} (the interpreter runs the plain loop)
    q_tiles_fastest: bool = False  # grid order: CTAs launched together share one head's K/V (L2 reuse)
    split_refill: bool = False  # refill a slot's K once k is released, not once k and v both are

    def __post_init__(self):
        if self.block_q % 64 or self.block_kv % 64:
            raise ValueError(f"block_q and block_kv must be multiples of 64, got {self}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
        if self.compute_registers not in (232, 240):
            raise ValueError(f"compute_registers must be 232 or 240, got {self.compute_registers}")

    @classmethod
    def for_head_dim(cls, head_dim: int, causal: bool = True) -> MgpuConfig:
        """The default tiles; non-causal D=128 takes the intra-warpgroup pipelined loop (tuning run 3 in
        benchmarks/results/flash_notes.md: 635 / 597 TFLOP/s vs 604 / 590 for the plain loop, one run)."""
        if head_dim > 128:
            return cls(block_kv=64)
        if head_dim == 128 and not causal:
            return cls(pipelined=True, split_refill=True)
        return cls()


def supports(q_dtype, head_dim: int, st) -> bool:
    """Whether the Mosaic GPU forward handles this call (`st` is flash_attention_common.KernelStatic)."""
    return (
        jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 64 == 0
        and head_dim <= 256
        and st.sliding_window is None
        and not st.has_segments
        and st.logits_soft_cap is None
        and st.static_q_offset is not None
    )


def tile_multiples(head_dim: int) -> tuple[int, int]:
    """(query, key) lengths must be padded to multiples of these for `forward`."""
    cfg = MgpuConfig.for_head_dim(head_dim)
    return COMPUTE_WGS * cfg.block_q, cfg.block_kv


def forward(q, k, v, st, cfg: MgpuConfig | None = None, interpret=None):
    """o [B, Tq_pad, Hq, D] and lse [B, Hq, Tq_pad] (natural log) from padded q [B, Tq_pad, Hq, D], k/v.

    `interpret`: None (compile for the GPU, unless traced under plgpu.force_gpu_interpret_mode()) or a
    plgpu.InterpretGPUParams to run the kernel in the Mosaic GPU interpreter on CPU.
    """
    batch, tq_pad, hq, head_dim = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    cfg = cfg or MgpuConfig.for_head_dim(head_dim, st.causal)
    if interpret is None:  # plgpu.force_gpu_interpret_mode() (the CPU tests) reaches us through this config
        forced = jax_config.pallas_tpu_interpret_mode_context_manager.value
        interpret = forced if isinstance(forced, plgpu.InterpretGPUParams) else None
    if tq_pad % (COMPUTE_WGS * cfg.block_q) or tk_pad % cfg.block_kv:
        raise ValueError(f"padded lengths {tq_pad}, {tk_pad} do not fit tiles {cfg}")
    num_q_tiles = tq_pad // (COMPUTE_WGS * cfg.block_q)
    num_kv_blocks = tk_pad // cfg.block_kv
    steps = min(cfg.max_concurrent_steps, num_kv_blocks)
    dims = _Dims(
        block_q=cfg.block_q,
        block_kv=cfg.block_kv,
        head_dim=head_dim,
        group=hq // hkv,
        steps=steps,
        num_q_tiles=num_q_tiles,
        num_kv_blocks=num_kv_blocks,
        dtype=q.dtype,
        pipelined=cfg.pipelined,
        compute_registers=cfg.compute_registers,
        split_refill=cfg.split_refill,
        interpret=interpret is not None,
    )

    def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, st=st, d=dims),
            (
                plgpu.SMEM((COMPUTE_WGS, cfg.block_q, head_dim), q.dtype, transforms=transforms),  # q, then o
                plgpu.SMEM((steps, cfg.block_kv, head_dim), q.dtype, transforms=transforms),  # k ring
                plgpu.SMEM((steps, cfg.block_kv, head_dim), q.dtype, transforms=transforms),  # v ring
                plgpu.SMEM((COMPUTE_WGS, cfg.block_q), jnp.float32),
            ),  # lse staging
            (
                plgpu.Barrier(num_barriers=steps),
                plgpu.Barrier(num_barriers=steps),
                plgpu.Barrier(num_barriers=COMPUTE_WGS),
            ),  # k ready, v ready, q ready
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),) * 2,  # k consumed, v consumed
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # tensor-core schedule (ping-pong)
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(out_struct(q.shape, q.dtype, (q, k, v)), out_struct((batch, hq, tq_pad), jnp.float32, (q, k, v))),
        grid=(num_q_tiles, hq, batch) if cfg.q_tiles_fastest else (hq, num_q_tiles, batch),
        grid_names=("q_seq", "heads", "batch") if cfg.q_tiles_fastest else ("heads", "q_seq", "batch"),
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
    pipelined: bool
    compute_registers: int
    split_refill: bool
    interpret: bool  # run by the Mosaic GPU interpreter: p @ v becomes a plain dot (see the module docstring)


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
        plgpu.set_max_registers(d.compute_registers, action="increase")
        _compute_wg(
            q_ref,
            o_ref,
            lse_ref,
            qo_smem2.at[wg],
            lse_smem2.at[wg],
            k_smem,
            v_smem,
            (k_ready, v_ready, q_ready.at[wg]),
            (k_consumed, v_consumed),
            schedule,
            q_base=cta_q_base + wg * d.block_q,
            cta_steps=cta_steps,
            st=st,
            d=d,
        )

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40 if d.compute_registers == 232 else 24, action="decrease")
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

    def wait_consumed(step):
        slot = lax.rem(step, jnp.array(d.steps, step.dtype))
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])
        return slot

    @pl.loop(0, _max(cta_steps - d.steps, 0))
    def _refill(step):
        if d.split_refill:  # k of step s is released after q @ k.T, long before v (after p @ v)
            slot = lax.rem(step, jnp.array(d.steps, step.dtype))
            rows = (batch, pl.ds((step + d.steps) * d.block_kv, d.block_kv), kv_head)
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])
        else:
            issue(step + d.steps, wait_consumed(step))

    # Observe the last `steps` releases too (nothing left to load): every barrier phase gets waited on by
    # each warpgroup that uses the barrier, as the Mosaic GPU interpreter checks. Idle time of this warpgroup.
    @pl.loop(_max(cta_steps - d.steps, 0), cta_steps)
    def _observe_last(step):
        wait_consumed(step)


def _compute_wg(
    q_ref,
    o_ref,
    lse_ref,
    qo_smem,
    lse_smem,
    k_smem,
    v_smem,
    ready,
    consumed,
    schedule,
    *,
    q_base,
    cta_steps,
    st,
    d: _Dims,
):
    k_ready, v_ready, q_ready = ready
    k_consumed, v_consumed = consumed
    batch, q_head = lax.axis_index("batch"), lax.axis_index("heads")
    wg = lax.axis_index("wg")
    scale2 = st.sm_scale * LOG2E

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def slot_of(step):
        return lax.rem(step, jnp.array(d.steps, jnp.int32))

    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, d.block_q), q_head], qo_smem, q_ready)
    plgpu.barrier_wait(q_ready)
    first_pos = st.static_q_offset + q_base  # key position of this warpgroup's first query row
    if st.causal:
        kv_steps = jnp.minimum((first_pos + d.block_q - 1) // d.block_kv + 1, d.num_kv_blocks)
        full_steps = (first_pos + 1) // d.block_kv
    else:
        kv_steps = full_steps = d.num_kv_blocks
    full_steps = _min(full_steps, st.kv_len // d.block_kv)  # the padded tail block needs a mask

    def mask(s, step):
        rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        kpos = cols + step * d.block_kv
        visible = kpos < st.kv_len
        if st.causal:
            visible = jnp.logical_and(visible, kpos <= rows + first_pos)
        return jnp.where(visible, s, -jnp.inf)

    def softmax(s, m_i):
        """p = exp2(s * scale2 - m_new) in f32, alpha = exp2(m_i - m_new), m_new (log2 domain, scaled)."""
        m_new = jnp.maximum(m_i, s.max(axis=1) * scale2)
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
        return p, alpha, m_new

    def wait_k(step):  # k of `step`, if this warpgroup will use it
        pl.when(step < kv_steps)(lambda: plgpu.barrier_wait(k_ready.at[slot_of(step)]))

    def kv_step(step, carry, masked: bool):
        acc, m_i, l_i = carry  # [bq, D] f32, [bq] f32 (log2 domain, scaled), [bq] f32
        slot = slot_of(step)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
            schedule_barrier()
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((d.block_q, d.block_kv), jnp.float32))  # [bq, bkv]
        plgpu.barrier_arrive(k_consumed.at[slot])
        if masked:
            s = mask(s, step)
        p, alpha, m_new = softmax(s, m_i)
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
            wait_k(step + 1)  # while p @ v runs on the tensor cores

        if d.interpret:  # no register-LHS wgmma / run_state in the interpreter: same product, plain dot
            acc += jnp.dot(p_lo, v_smem[slot], preferred_element_type=jnp.float32)
            wait_k(step + 1)
        else:
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_new, l_i

    def drain(step, _):  # keep the memory warpgroup's ring moving for steps only the other warpgroup needs
        slot = slot_of(step)
        # Waiting for loads this warpgroup does not read costs nothing (the other warpgroup's matmul on them
        # gates the schedule barrier below) and keeps every phase observed, as the interpreter requires.
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])
        schedule_barrier()
        schedule_barrier()

    acc = plgpu.layout_cast(jnp.zeros((d.block_q, d.head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((d.block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((d.block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    plgpu.barrier_wait(k_ready.at[0])
    pl.when(wg == 1)(schedule_barrier)
    if d.pipelined and not d.interpret:
        acc = _pipelined_steps(
            acc,
            m_i,
            l_i,
            lse_smem,
            qo_smem,
            k_smem,
            v_smem,
            ready,
            consumed,
            schedule_barrier,
            schedule,
            mask,
            softmax,
            wait_k,
            slot_of,
            full_steps,
            kv_steps,
            d,
        )
    else:
        carry = lax.fori_loop(0, full_steps, lambda i, c: kv_step(i, c, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, lambda i, c: kv_step(i, c, masked=True), carry)
        acc *= lax.broadcast_in_dim(1.0 / l_i, acc.shape, [0])
        lse_smem[...] = (m_i + jnp.log2(l_i)) * LN2
    lax.fori_loop(kv_steps, cta_steps, drain, None)
    pl.when(wg == 0)(schedule_barrier)

    qo_smem[...] = acc.astype(d.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[batch, pl.ds(q_base, d.block_q), q_head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_base, d.block_q)])
    plgpu.wait_smem_to_gmem(0)


def _pipelined_steps(
    acc,
    m_i,
    l_i,
    lse_smem,
    qo_smem,
    k_smem,
    v_smem,
    ready,
    consumed,
    schedule_barrier,
    schedule,
    mask,
    softmax,
    wait_k,
    slot_of,
    full_steps,
    kv_steps,
    d: _Dims,
):
    """FA3's intra-warpgroup overlap: step i issues q @ k_i.T and p_{i-1} @ v_{i-1} back to back, waits only
    for the first, and runs softmax(s_i) while p_{i-1} @ v_{i-1} is still on the tensor cores.

    acc lives in one wgmma accumulator for the whole loop (rescaled in place), so the normalised acc comes
    out of the run_state and lse goes to `lse_smem` from inside it. GPU only (the interpreter has no
    run_state); same barrier protocol per step as the plain loop.
    """
    k_ready, v_ready, _ = ready
    k_consumed, v_consumed = consumed

    def main(acc_ref):
        def step(i, carry, masked: bool, first: bool = False):
            m_i, l_i, p_prev = carry
            slot = slot_of(i)

            def qk(s_ref):
                plgpu.wgmma(s_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                if not first:
                    plgpu.wgmma(acc_ref, p_prev, v_smem.at[slot_of(i - 1)])
                schedule_barrier()
                return plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if first else 1)

            s = pl.run_scoped(qk, plgpu.ACC((d.block_q, d.block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            if masked:
                s = mask(s, i)
            p, alpha, m_new = softmax(s, m_i)
            l_i = l_i * alpha + p.sum(axis=1)
            p_lo = p.astype(d.dtype)
            if not first:  # p_{i-1} @ v_{i-1} done: release v, rescale acc to the new running max
                acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                plgpu.barrier_arrive(v_consumed.at[slot_of(i - 1)])
            plgpu.barrier_arrive(schedule)  # softmax done: let the other warpgroup's matmul go
            wait_k(i + 1)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(schedule)
            return m_new, l_i, p_lo

        p0 = plgpu.layout_cast(jnp.zeros((d.block_q, d.block_kv), d.dtype), plgpu.Layout.WGMMA)
        carry = step(jnp.int32(0), (m_i, l_i, p0), masked=True, first=True)  # a needless mask once per tile
        start = _max(full_steps, 1)
        carry = lax.fori_loop(1, start, lambda i, c: step(i, c, masked=False), carry)
        m_f, l_f, p_last = lax.fori_loop(start, kv_steps, lambda i, c: step(i, c, masked=True), carry)
        plgpu.wgmma(acc_ref, p_last, v_smem.at[slot_of(kv_steps - 1)])
        out = acc_ref[...]
        plgpu.barrier_arrive(v_consumed.at[slot_of(kv_steps - 1)])
        acc_ref[...] = out * lax.broadcast_in_dim(1.0 / l_f, out.shape, [0])
        lse_smem[...] = (m_f + jnp.log2(l_f)) * LN2

    return pl.run_state(main)(plgpu.ACC.init(acc))
