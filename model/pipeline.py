"""Pipeline parallelism: the decoder's layers split into stages over the mesh's "pipeline" axis, GPipe-style.

`pipelined(model, mesh)` moves the L layers of a Transformer into one `PipelinedLayers` module that stands in the
model's layer list for all of them, so the Transformer's embedding, head, caches and metadata code is unchanged:

    tokens -> embed -> [PipelinedLayers: L layers in p stages] -> norm -> lm_head
    caches:  [per-stage pools]   one "layer" holding every layer's pages (below)

Stage s holds layers start_s .. start_s + n_s - 1 and only their KV pages. The L layers are split as evenly as
possible (`stage_sizes`, vLLM's rule: the L % p extra layers go to the stages before the last, from the
second-to-last backwards), n = max n_s. The arrays are grouped by a stage's local layer l: entry l stacks global
layers start_s + l of every stage on a leading [p] axis sharded over "pipeline", so inside the stage program its
slice is [1, ...] and taking it is free (a slice of an [L, ...] stack would be a copy of the layer's weights and
pages at every tick):

    stack[l]: every parameter of layers {start_s + l}   [p, ...]           stage s: [1, ...] = layer start_s + l
    cache:    [((k_l, v_l) for l < n)]                  each [p, Hkv, P, ps, hd]

A stage with n_s < n layers holds a copy of its last layer in the missing entries and passes its activations
through them unchanged (their output and KV pages are unused): an uneven split costs those stages one layer's
weights, pages and compute per missing layer, and the step waits for the longest stage anyway.

Inside a stage, tensor parallelism works as without pipelining (GSPMD on the auto "tensor" axis; the KV write +
kernel in model/kv.py's nested shard_map).

The step's batch is cut into m microbatches (a decode batch by rows, a ragged batch by contiguous token chunks)
that flow through the stages in m + p - 1 ticks; at tick t stage s runs microbatch t - s, then hands its
activations to stage s + 1 with one ppermute, so every stage works at once in the steady state:

    tick:      0    1    2    3    4          (m = 3, p = 3)
    stage 0:  mb0  mb1  mb2   .    .          utilisation = m / (m + p - 1) = 3 / 5
    stage 1:   .   mb0  mb1  mb2   .
    stage 2:   .    .   mb0  mb1  mb2

A token chunk may end mid-sequence: the rest of that sequence is in the next microbatch, which reaches each stage
one tick later, after this chunk's K/V are written there, so it attends exactly as a chunked prefill does. Idle
(bubble) ticks compute on stale data but write K/V only to the null page 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from model.kv import PagedMeta, init_paged_cache
from model.layers import rope_inv_freq
from model.quant import QuantizedArray
from model.transformer import _LAYER_PATHS, Transformer
from sharding.config import check_pipeline, stage_sizes, stage_starts
from sharding.mesh import PIPELINE
from sharding.rules import kv_cache_sharding, param_partition_spec

_PATH_NAMES = {path: name for name, path in _LAYER_PATHS.items()}  # module path -> canonical per-layer name


def num_stages(mesh: jax.sharding.Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape.get(PIPELINE, 1)


def gpipe_schedule(m: int, p: int) -> np.ndarray:
    """busy [m + p - 1 ticks, p stages] bool: stage s runs microbatch t - s at tick t when 0 <= t - s < m."""
    t, s = np.arange(m + p - 1)[:, None], np.arange(p)[None, :]
    return (t - s >= 0) & (t - s < m)


def microbatches(m: int, rows: int) -> int:
    """The microbatches a step of `rows` rows (decode) or tokens (ragged) is cut into: the largest divisor <= m."""
    return math.gcd(m, rows)


class PipelinedLayers(nnx.Module):
    """All L layers of a Transformer as p pipeline stages; called like one Block of model/transformer.py.

    Attributes:
        stack: per local layer l, its parameters of every stage stacked [p, ...], sharded over "pipeline".
        graphdefs: the n = max n_s layer graphs of a stage (stage s's layer l has the structure of layer l).
        sizes: n_s, the real layers of each stage (`stage_sizes`).
        num_microbatches: m, microbatches per step (fewer when the batch does not divide; `microbatches`).
    """

    def __init__(self, model: Transformer, mesh: jax.sharding.Mesh, num_microbatches: int | None = None):
        cfg, p = model.cfg, num_stages(mesh)
        check_pipeline(cfg, p)
        self.cfg, self.mesh, self.num_stages = cfg, mesh, p
        self.num_microbatches = num_microbatches or p
        self.sizes = stage_sizes(cfg.num_layers, p)
        starts, n = stage_starts(cfg.num_layers, p), max(self.sizes)
        graphdefs, states = zip(*(nnx.split(layer) for layer in model.layers))
        self.graphdefs = graphdefs[:n]
        # Stage s's entry l: its layer start_s + l, or a copy of its last layer where it has fewer than n.
        per_stage = [[states[a + min(l, k - 1)] for a, k in zip(starts, self.sizes)] for l in range(n)]
        self.stack = nnx.data([_stack_placed(layer, mesh, cfg.head_dim) for layer in per_stage])

    def __call__(self, x_btd, positions_bt, inv_freq, cache, meta: PagedMeta, valid=None):
        """x [1, T, D] of the whole step -> (x [1, T, D] after all layers, the per-stage pools, None)."""
        del inv_freq, valid  # each stage layer's own RoPE base; dense layers count no router statistics
        x, cache, _ = self.run(x_btd[0], positions_bt[0], cache, meta)
        return x[None], cache, None

    def run(self, x_td, positions_t, cache, meta: PagedMeta):
        """(x [T, D] after the L layers, cache, busy [p] int32: ticks each stage ran a real microbatch)."""
        p, t = self.num_stages, x_td.shape[0]
        m = microbatches(self.num_microbatches, meta.kv_lens.shape[0] if meta.decode_only else t)
        mbs = split_meta(meta, m)
        x_mb, pos_mb = x_td.reshape(m, t // m, -1), positions_t.reshape(m, t // m)
        staged, whole = PartitionSpec(PIPELINE), PartitionSpec()
        stage = jax.shard_map(
            self._stage,
            mesh=self.mesh,
            in_specs=(staged, staged, whole, whole, whole),  # layer weights, KV pool; activations, positions, metas
            out_specs=(staged, staged, staged),
            axis_names={PIPELINE},
            check_vma=False,
        )
        outs, cache, busy = stage(self.stack, tuple(map(tuple, cache)), x_mb, pos_mb, mbs)
        return outs[p - 1].reshape(t, -1), cache, busy  # the last stage's outputs [p, m, T/m, D] -> [T, D]

    def _stage(self, stack, kv, x_mb, pos_mb, mbs: PagedMeta):
        """One stage (inside shard_map over "pipeline"): m + p - 1 ticks over its n layers."""
        p, m = self.num_stages, x_mb.shape[0]
        stage = jax.lax.axis_index(PIPELINE)
        # The nested shard_map of model/kv.py (tensor parallelism) must name the mesh this one made manual.
        mesh = jax.sharding.get_abstract_mesh()

        def tick(t, carry):
            state, kv, outs, busy_ticks = carry
            j = t - stage  # the microbatch this stage runs now
            busy = (j >= 0) & (j < m)
            jc = jnp.clip(j, 0, m - 1)
            h = jnp.where(stage == 0, x_mb[jnp.minimum(t, m - 1)], state)
            mb = jax.tree.map(lambda a: a[jc], mbs)
            meta = dataclasses.replace(mb, slot_mapping=jnp.where(busy, mb.slot_mapping, 0), mesh=mesh)
            h, kv = self._layers(stack, kv, h, pos_mb[jc], meta, jnp.asarray(self.sizes)[stage])
            done = busy & (stage == p - 1)
            outs = outs.at[jc].set(jnp.where(done, h, outs[jc]))
            state = jax.lax.ppermute(h, PIPELINE, [(i, (i + 1) % p) for i in range(p)])
            return state, kv, outs, busy_ticks + busy.astype(jnp.int32)

        init = (jnp.zeros_like(x_mb[0]), kv, jnp.zeros_like(x_mb), jnp.int32(0))
        _, kv, outs, busy_ticks = jax.lax.fori_loop(0, m + p - 1, tick, init)
        return outs[None], kv, busy_ticks[None]

    def _layers(self, stack, kv, h_td, pos_t, meta, size):
        """The stage's n layers on one microbatch h [T/m, D]; every array here is its stage's [1, ...] slice.
        Entries at or past the stage's `size` real layers pass h through."""
        cfg, h, new_kv = self.cfg, h_td[None], []
        for l, graphdef in enumerate(self.graphdefs):
            block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stack[l]))
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.layer_rope_theta(l), cfg.layer_rope_scaling(l))
            out, cache, _ = block(h, pos_t[None], inv_freq, tuple(a[0] for a in kv[l]), meta)
            h = out if l < min(self.sizes) else jnp.where(l < size, out, h)
            new_kv.append(tuple(c[None] for c in cache))
        return h[0], tuple(new_kv)


def _stack_placed(states, mesh, head_dim: int):
    """The states of one local layer, one per stage -> one state of [p, ...] arrays, the stage axis on "pipeline" and
    the others as each layer already lies (placed on its stage by sharding/rules.py param_shardings, in whatever
    layout placement chose), or, for layers not placed yet, as the rules table says for their canonical name."""
    leaves = [jax.tree_util.tree_leaves_with_path(s, is_leaf=lambda x: isinstance(x, QuantizedArray)) for s in states]
    if any(isinstance(v, QuantizedArray) for _, v in leaves[0]):
        raise ValueError("pipeline_parallel_size > 1 needs float weights (quantized linear weights are not stacked)")
    stacked = []
    for i, (path, first) in enumerate(leaves[0]):
        sharding = getattr(first, "sharding", None)
        if isinstance(sharding, NamedSharding) and jax.process_count() > 1:
            # A stage's layers lie on another process's devices: each process stacks the shards it holds.
            inner = tuple(sharding.spec) + (None,) * (first.ndim - len(sharding.spec))
            stacked.append(_stack_shards([layer[i][1] for layer in leaves], mesh, PartitionSpec(PIPELINE, *inner)))
            continue
        value = np.stack([np.asarray(layer[i][1]) for layer in leaves])  # through the host: one leaf at a time
        if isinstance(sharding, NamedSharding):
            inner = tuple(sharding.spec) + (None,) * (first.ndim - len(sharding.spec))
            spec = PartitionSpec(PIPELINE, *inner)
        else:
            keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
            name = _PATH_NAMES[tuple(k for k in keys if k != "value")]
            spec = param_partition_spec(f"layers.0.{name}", value.shape, mesh, head_dim=head_dim)
        stacked.append(jax.device_put(value, NamedSharding(mesh, spec)))
    return jax.tree.unflatten(jax.tree.structure(states[0]), stacked)


def _stack_shards(per_stage: list[jax.Array], mesh, spec: PartitionSpec) -> jax.Array:
    """[p, ...] on `mesh` with `spec` from one array per stage, each on its stage's devices with the inner spec,
    built from this process's shards (no host copy; a multi-process job's stages are on different processes)."""
    out = NamedSharding(mesh, spec)
    stage = {d: s for s, a in enumerate(per_stage) for d in a.sharding.device_set}
    shards = {sh.device: sh.data for a in per_stage for sh in a.addressable_shards}
    missing = [d for d in out.addressable_devices if d not in shards or stage[d] != _stage_of(mesh, d)]
    if missing:
        raise ValueError(f"pipeline: layer weights are not on their stage's devices ({missing[:2]})")
    arrays = [shards[d][None] for d in out.addressable_devices_indices_map((len(per_stage), *per_stage[0].shape))]
    return jax.make_array_from_single_device_arrays((len(per_stage), *per_stage[0].shape), out, arrays)


def _stage_of(mesh, device) -> int:
    """The pipeline coordinate of `device` in `mesh`."""
    where = np.argwhere(mesh.devices == device)[0]
    return int(where[mesh.axis_names.index(PIPELINE)])


def split_meta(meta: PagedMeta, m: int) -> PagedMeta:
    """The step's metadata as m microbatches (every array field with a leading [m] axis).

    Decode: rows r*j .. r*j + r - 1 (r = S / m), one token each. Ragged: tokens c*j .. c*j + c - 1 (c = T / m) of
    the flat batch; every sequence keeps its row, with only its queries inside the chunk:

        cu_q_lens   0     5        11  (T = 12, m = 2, c = 6)     chunk 1: cu 0 0 5 ; row 0 has no queries,
        row         [ 0  ][  1      ]                              row 1's kv_len drops the 0 tokens after it
        chunk 0: cu 0 5 6 ; row 1 has 1 query, its kv_len less the 5 tokens of chunk 1
    """
    if meta.decode_only:
        s, w = meta.block_tables.shape
        r = s // m
        return dataclasses.replace(
            meta,
            slot_mapping=meta.slot_mapping.reshape(m, r),
            block_tables=meta.block_tables.reshape(m, r, w),
            kv_lens=meta.kv_lens.reshape(m, r),
            cu_q_lens=jnp.broadcast_to(jnp.arange(r + 1, dtype=jnp.int32), (m, r + 1)),
            num_seqs=jnp.clip(meta.num_seqs - r * jnp.arange(m, dtype=jnp.int32), 0, r),
        )
    t = meta.slot_mapping.shape[0]
    c = t // m
    lo = c * jnp.arange(m, dtype=jnp.int32)[:, None]  # [m, 1] first token of each chunk
    cu = jnp.clip(meta.cu_q_lens[None], lo, lo + c) - lo  # [m, S + 1]
    after = meta.cu_q_lens[None, 1:] - lo - cu[:, 1:]  # [m, S] tokens of each row past the chunk
    return dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping.reshape(m, c),
        block_tables=jnp.broadcast_to(meta.block_tables, (m, *meta.block_tables.shape)),
        kv_lens=meta.kv_lens[None] - after,
        cu_q_lens=cu,
        num_seqs=jnp.broadcast_to(meta.num_seqs, (m,)),
    )


def pipelined(model: Transformer, mesh: jax.sharding.Mesh, num_microbatches: int | None = None) -> Transformer:
    """`model` with its layers replaced by one PipelinedLayers over `mesh` (in place; the layer modules are
    dropped, their parameters live on in the stages)."""
    model.layers = nnx.List([PipelinedLayers(model, mesh, num_microbatches)])
    return model


def init_stage_cache(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, mesh
) -> list[tuple[tuple[jax.Array, ...], ...]]:
    """The paged pool as one "layer" of the runner's cache list: [((k_l, v_l[, k_scales_l, v_scales_l]) for each
    local layer l < n = max n_s)], every array [p, Hkv, P, ps, hd] (scales [p, Hkv, P, ps]) with its stage axis on
    "pipeline", so each stage's devices hold only the pages of its own layers start_s + l."""
    p = num_stages(mesh)
    one = init_paged_cache(1, num_pages, page_size, num_kv_heads, head_dim, dtype)[0]
    shardings = tuple(kv_cache_sharding((p, *a.shape), mesh, stacked=True) for a in one)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        return tuple(jnp.broadcast_to(a, (p, *a.shape)) for a in one)

    return [tuple(init() for _ in range(max(stage_sizes(num_layers, p))))]


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_stage_pages(kv, src, dst):
    """Copy-on-write in the per-stage pools: block dst := block src in every layer (page axis 2; scales too)."""
    return jax.tree.map(lambda a: a.at[:, :, dst].set(a[:, :, src]), kv)
