"""Logical axis names -> mesh axes: the one place sharding decisions live.

Each canonical parameter (docs/ARCHITECTURE.md) and the paged KV cache name their dimensions with logical axes;
LOGICAL_AXIS_RULES (after MaxText's `logical_axis_rules`) maps each logical axis to a mesh axis of
sharding/mesh.py. Megatron-style tensor parallelism falls out of the table: wq/wk/wv/w_gate/w_up split their
output columns (heads, MLP width), wo/w_down split their input rows, so each layer needs one all-reduce after
attention and one after the MLP, which GSPMD inserts.

Divisibility fallback: a dimension whose size is not a multiple of its mesh axis size (e.g. 3 KV heads with tp=2,
or a vocabulary of 32001 with tp=8) is replicated instead of sharded; the rest of the array keeps its sharding.
Head axes are counted in heads, not elements: pass `head_dim` so that `[D, Hkv*hd]` with Hkv=3, hd=64 on tp=2 is
replicated rather than split mid-head (192 elements would divide evenly, 3 heads do not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import DATA, EXPERT, PIPELINE, TENSOR

LogicalAxes = tuple[str | None, ...]
MeshAxes = str | tuple[str, ...] | None

# Logical axis -> mesh axis, a tuple of mesh axes (split over their product, trailing axes dropped until the
# size divides), or None: replicated. The single rules table.
LOGICAL_AXIS_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", DATA),
    ("vocab", TENSOR),
    ("embed", None),
    ("q_heads", TENSOR),
    ("kv_heads", TENSOR),
    ("mlp", TENSOR),
    # MoE experts: over the expert axis and, when E divides, the tensor axis too (the routed experts' matmuls are
    # not split by width, so a TP-only mesh still spreads the experts instead of copying them to every device).
    ("experts", (EXPERT, TENSOR)),
    ("expert_mlp", None),
    ("router", None),
    # Canonical params are per layer; stacked [L, ...] (pipeline parallelism, model/pipeline.py) they split into
    # stages of consecutive layers, and so does the stacked KV pool.
    ("layers", PIPELINE),
    ("fused", None),  # fused q|k|v and gate|up columns (split by their own per-shard layout, model/fused.py)
)
_RULES = dict(LOGICAL_AXIS_RULES)

# Canonical names outside the layers -> logical axes of their dimensions.
GLOBAL_PARAM_AXES: dict[str, LogicalAxes] = {
    "embed": ("vocab", "embed"),  # [V, D]
    "final_norm": ("embed",),  # [D]
    "lm_head": ("embed", "vocab"),  # [D, V]
}
# Per-layer canonical names ("layers.{i}.<key>") -> logical axes of their dimensions.
LAYER_PARAM_AXES: dict[str, LogicalAxes] = {
    "attn_norm": ("embed",),  # [D]
    "mlp_norm": ("embed",),  # [D]
    "wq": ("embed", "q_heads"),  # [D, Hq*hd]
    "wk": ("embed", "kv_heads"),  # [D, Hkv*hd]
    "wv": ("embed", "kv_heads"),  # [D, Hkv*hd]
    "wo": ("q_heads", "embed"),  # [Hq*hd, D]
    "w_gate": ("embed", "mlp"),  # [D, F]
    "w_up": ("embed", "mlp"),  # [D, F]
    "w_down": ("mlp", "embed"),  # [F, D]
    # Fused storage (model/fused.py): laid out per tensor-parallel shard by serving/engine/weights.py
    # place_on_mesh, which splits them over the tensor axis itself; by name alone they are replicated.
    "wqkv": ("embed", "fused"),  # [D, q + 2 kv]
    "bqkv": ("fused",),  # [q + 2 kv]
    "gate_up": ("embed", "fused"),  # [D, 2F]
    "bq": ("q_heads",),  # [Hq*hd]
    "bk": ("kv_heads",),  # [Hkv*hd]
    "bv": ("kv_heads",),  # [Hkv*hd]
    "q_norm": (None,),  # [hd] (Gemma 3 QK-norm, per head width)
    "k_norm": (None,),  # [hd]
    "post_attn_norm": ("embed",),  # [D] (Gemma 3)
    "post_mlp_norm": ("embed",),  # [D]
    # MoE MLP (model/moe.py): the routed experts split by expert, the router and the shared expert like a dense MLP.
    "w_router": ("embed", "router"),  # [D, E]
    "w_gate_up": ("experts", "embed", "expert_mlp"),  # [E, D, 2F]
    "w_experts_down": ("experts", "expert_mlp", "embed"),  # [E, F, D]
    "shared_gate": ("embed", None),  # [D, 1]
    "shared_w_gate": ("embed", "mlp"),  # [D, Fs]
    "shared_w_up": ("embed", "mlp"),  # [D, Fs]
    "shared_w_down": ("mlp", "embed"),  # [Fs, D]
    # gpt-oss: attention sinks and output bias, the router's and the routed experts' biases.
    "sinks": ("q_heads",),  # [Hq]
    "bo": ("embed",),  # [D]
    "b_router": ("router",),  # [E]
    "b_gate_up": ("experts", "expert_mlp"),  # [E, 2F]
    "b_experts_down": ("experts", "embed"),  # [E, D]
}

KV_PAGES_AXES: LogicalAxes = ("kv_heads", None, None, None)  # k/v pages [Hkv, num_pages, page_size, hd]
KV_SCALES_AXES: LogicalAxes = ("kv_heads", None, None)  # k/v scales [Hkv, num_pages, page_size]


def param_logical_axes(name: str, ndim: int | None = None) -> LogicalAxes:
    """Logical axes of canonical parameter `name`; a leading "layers" axis is added when ndim says it is stacked.

    Raises:
        ValueError: `name` is not a canonical parameter, or ndim fits neither the per-layer nor stacked form.
    """
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        axes = LAYER_PARAM_AXES.get(parts[2])
    else:
        axes = GLOBAL_PARAM_AXES.get(name)
    if axes is None:
        raise ValueError(f"{name!r} is not a canonical parameter name (see docs/ARCHITECTURE.md)")
    if ndim is None or ndim == len(axes):
        return axes
    if ndim == len(axes) + 1:
        return ("layers",) + axes
    raise ValueError(f"parameter {name!r} has {ndim} dims; expected {len(axes)} (or {len(axes) + 1} stacked)")


def logical_partition_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, units: Mapping[str, int] | None = None
) -> PartitionSpec:
    """Maps logical axes to a PartitionSpec on `mesh` through LOGICAL_AXIS_RULES, replicating what cannot split.

    Args:
        logical_axes: one logical name (or None) per dimension of `shape`.
        shape: the array's shape.
        mesh: the target mesh; rules naming an axis the mesh lacks count as replicated.
        units: logical axis -> elements per indivisible unit (e.g. {"kv_heads": head_dim}); a dimension shards
            only when its unit count is a multiple of the mesh axis size.

    Returns:
        The PartitionSpec, with None for every replicated dimension.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"{len(logical_axes)} logical axes {tuple(logical_axes)} for shape {tuple(shape)}")
    units = units or {}
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for logical, size in zip(logical_axes, shape):
        if logical is not None and logical not in _RULES:
            raise ValueError(f"logical axis {logical!r} has no rule in LOGICAL_AXIS_RULES")
        rule = _RULES.get(logical)
        # Size-1 mesh axes shard nothing; leaving them out keeps specs equal across mesh shapes.
        axes = [a for a in ((rule,) if isinstance(rule, str) else rule or ()) if sizes.get(a, 1) > 1 and a not in used]
        unit = units.get(logical, 1)
        while axes and not (size % unit == 0 and (size // unit) % _product(sizes[a] for a in axes) == 0):
            axes.pop()  # drop trailing axes until the dimension divides
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def param_partition_spec(name: str, shape: Sequence[int], mesh: Mesh, *, head_dim: int | None = None) -> PartitionSpec:
    """PartitionSpec of canonical parameter `name` with `shape` on `mesh`.

    Args:
        name: canonical name, e.g. "layers.3.wk".
        shape: its shape (per layer, or stacked with a leading layer axis).
        mesh: the target mesh.
        head_dim: the model's head width, so head axes only split on head boundaries (recommended).
    """
    units = {"q_heads": head_dim, "kv_heads": head_dim} if head_dim else None
    return logical_partition_spec(param_logical_axes(name, len(shape)), shape, mesh, units)


def param_shardings(
    params_shapes: Mapping[str, Any], mesh: Mesh, *, head_dim: int | None = None
) -> dict[str, NamedSharding]:
    """NamedSharding for every parameter; values may be arrays, ShapeDtypeStructs or plain shape tuples.

    On a mesh with a pipeline axis, per-layer parameters `layers.{i}.*` go to the devices of their stage only (a
    sub-mesh of pipeline size 1; consecutive layers per stage, as model/pipeline.py stacks them), so a checkpoint
    restored for pipelining reads each layer into one stage's memory; the other parameters span the whole mesh.
    """
    stages = stage_meshes(mesh)
    layers = [int(n.split(".")[1]) for n in params_shapes if n.startswith("layers.") and n.split(".")[1].isdigit()]
    num_layers = max(layers, default=0) + 1
    out = {}
    for name, x in params_shapes.items():
        parts = name.split(".")
        layer = int(parts[1]) if parts[0] == "layers" and len(parts) == 3 and parts[1].isdigit() else None
        on = mesh if layer is None or len(stages) == 1 else stages[layer * len(stages) // num_layers]
        out[name] = NamedSharding(on, param_partition_spec(name, getattr(x, "shape", x), on, head_dim=head_dim))
    return out


def quantized_expert_sharding(value: Any, sharding: Any) -> Any:
    """Shardings of the leaves of a quantised stacked-experts weight (model/quant.py QuantizedArray, every leaf
    [E, ...]: codes, scales, zero points), each split over E as `sharding` (the float [E, K, N] weight's, from
    LAYER_PARAM_AXES "experts") splits it, so every device holds the codes and scales of its own experts; None
    for anything else (dense quantised projections are replicated, model/transformer.py `_place`)."""
    values = getattr(value, "values", None)
    spec = tuple(getattr(sharding, "spec", ()))
    if values is None or values.ndim != 3 or not spec or spec[0] is None or any(a is not None for a in spec[1:]):
        return None
    split = NamedSharding(sharding.mesh, PartitionSpec(spec[0]))
    return jax.tree.map(lambda _: split, value)


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """The sub-mesh of each pipeline stage (its pipeline axis of size 1), in stage order; [mesh] without one."""
    axis = mesh.axis_names.index(PIPELINE) if PIPELINE in mesh.axis_names else None
    if axis is None or mesh.devices.shape[axis] == 1:
        return [mesh]
    take = lambda s: mesh.devices.take([s], axis=axis)  # noqa: E731
    return [Mesh(take(s), mesh.axis_names, axis_types=mesh.axis_types) for s in range(mesh.devices.shape[axis])]


def shard_params(params: Mapping[str, Any], mesh: Mesh, *, head_dim: int | None = None) -> dict[str, jax.Array]:
    """Places host arrays onto `mesh` with param_shardings (each host transfers only its own shards)."""
    shardings = param_shardings(params, mesh, head_dim=head_dim)
    return {name: jax.device_put(x, shardings[name]) for name, x in params.items()}


def kv_cache_sharding(shape: Sequence[int], mesh: Mesh, *, stacked: bool = False) -> NamedSharding:
    """Sharding of paged KV pages `[Hkv, num_pages, page_size, hd]` or scales `[Hkv, num_pages, page_size]`;
    `stacked`: with a leading layer axis `[L, ...]` (the pipeline's pool, split into stages)."""
    axes = {4: KV_PAGES_AXES, 3: KV_SCALES_AXES}.get(len(shape) - stacked)
    if axes is None:
        raise ValueError(f"KV pages are 4-D and scales 3-D (one more stacked); got shape {tuple(shape)}")
    return NamedSharding(mesh, logical_partition_spec(("layers",) * stacked + axes, shape, mesh))


def kv_cache_heads(num_kv_heads: int, mesh: Mesh) -> int:
    """KV heads the paged pool holds on `mesh`: num_kv_heads, or the tensor-parallel degree when there are fewer KV
    heads than devices (each head repeated tp / Hkv times, model/kv.py), so the pool still splits one head per
    device; per device that is the memory of one head, as when the heads divide."""
    tp = dict(zip(mesh.axis_names, mesh.devices.shape)).get(TENSOR, 1)
    if 1 < tp and num_kv_heads < tp and tp % num_kv_heads == 0:
        return tp
    return num_kv_heads
