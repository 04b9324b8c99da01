"""Fused projections: q|k|v and gate|up stored as one weight each, so each is one matmul (one weight read).

Checkpoints and every loader keep the canonical names (docs/ARCHITECTURE.md: wq, wk, wv, w_gate, w_up, bq, bk,
bv); `build_model` concatenates the parts of each group as it reads them and writes the fused slot once. The
fused output axis is laid out per tensor-parallel shard, so a column split of the fused weight gives every device
whole heads of each part (and, for gate/up, the matching halves):

    fused columns   [ shard 0: q_0 | k_0 | v_0 ][ shard 1: q_1 | k_1 | v_1 ] ... (`shards` blocks of equal width)

    part p (n units: heads, or MLP columns) over s shards:  n % s == 0 -> shard j holds units [j n/s, (j+1) n/s)
                                                            s % n == 0 -> shard j holds unit j // (s/n) (repeated)

The repeated case is the KV heads of a model with fewer KV heads than devices: shard j then computes exactly the
KV head its query heads read, the layout the paged pool already holds (sharding/rules.py kv_cache_heads). With
shards = 1 the layout is the plain concatenation. A part's output is `y.reshape(..., s, per)[..., off:off+w]`
reshaped back: heads in order (repeated heads adjacent), so no collective is needed.

Values may be host arrays (numpy), jax arrays, or QuantizedArrays whose column leaves (values, scales, zeros:
last axis = output channel; an "nk" weight's values are handled as their [K, N] transpose) concatenate; the per-input-channel pre_scale and the activation scale are shared by
the parts of a group, so parts quantised separately with different ones (AWQ / SmoothQuant per projection) are
dequantised to float instead (correct, at float size; quantising the fused weight shares them).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.quant import QuantizedArray

log = logging.getLogger(__name__)

# Storage leaf -> canonical leaves it fuses, in column order.
GROUPS: dict[str, tuple[str, ...]] = {
    "wqkv": ("wq", "wk", "wv"),
    "bqkv": ("bq", "bk", "bv"),
    "gate_up": ("w_gate", "w_up"),
}


@dataclasses.dataclass(frozen=True)
class Part:
    """One canonical part of a fused group: `width` output columns made of `units` indivisible units."""

    name: str
    width: int
    units: int

    def blocks(self, shards: int) -> int:
        """Equal blocks the part is cut into for `shards` (module docstring); raises if neither divides."""
        if self.units % shards == 0:
            return shards
        if shards % self.units == 0:
            return self.units
        raise ValueError(f"{self.name}: {self.units} units fit neither split nor repeat over {shards} shards")


def group_parts(cfg: ModelConfig, leaf: str) -> tuple[Part, ...]:
    """The parts of fused storage leaf `leaf` (a key of GROUPS) for `cfg`: heads for q/k/v, columns for gate/up."""
    if leaf in ("wqkv", "bqkv"):
        q, k, v = GROUPS[leaf]
        return (
            Part(q, cfg.q_size, cfg.num_heads),
            Part(k, cfg.kv_size, cfg.num_kv_heads),
            Part(v, cfg.kv_size, cfg.num_kv_heads),
        )
    if leaf == "gate_up":
        f = cfg.intermediate_size
        return Part("w_gate", f, f), Part("w_up", f, f)
    raise ValueError(f"{leaf!r} is not a fused parameter; fused ones: {sorted(GROUPS)}")


def fused_width(parts: Sequence[Part], shards: int) -> int:
    """Output columns of the fused weight (wider than the sum when a part is repeated)."""
    return shards * sum(p.width // p.blocks(shards) for p in parts)


def _is_np(x) -> bool:
    return not isinstance(x, jax.Array)


def _cat(xs: Sequence[Any]) -> Any:
    if all(_is_np(x) for x in xs):
        return np.concatenate([np.asarray(x) for x in xs], axis=-1)
    return jnp.concatenate([jnp.asarray(x) for x in xs], axis=-1)


def _cols(x, start: int, stop: int):
    return x[..., start:stop]


_COLUMN_LEAVES = ("values", "scales", "zeros")
_SHARED_LEAVES = ("pre_scale", "act_scale")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _compatible(qs: Sequence[QuantizedArray]) -> bool:
    q0 = qs[0]
    for q in qs[1:]:
        if (q.fmt, q.group_size, q.act_fmt, q.layout) != (q0.fmt, q0.group_size, q0.act_fmt, q0.layout):
            return False
        if (q.zeros is None) != (q0.zeros is None) or q.scales.ndim != q0.scales.ndim or q.scales.ndim == 0:
            return False
        if not all(_same(getattr(q, n), getattr(q0, n)) for n in _SHARED_LEAVES):
            return False
    return True


def _map_columns(values: Sequence[Any], fn):
    """fn(list of column arrays) applied leaf-wise: plain arrays, or QuantizedArrays sharing fmt and shared leaves."""
    if not any(isinstance(v, QuantizedArray) for v in values):
        return fn(list(values))
    if not all(isinstance(v, QuantizedArray) for v in values) or not _compatible(values):
        log.warning("fused projection: parts of different quantised layouts are dequantised to float32")
        return fn([v.dequantize(jnp.float32) if isinstance(v, QuantizedArray) else v for v in values])
    q0 = values[0]

    def columns(q, name):  # the leaf with the output channel last
        return q.values_kn if name == "values" else getattr(q, name)

    leaves = {n: fn([columns(v, n) for v in values]) for n in _COLUMN_LEAVES if getattr(q0, n) is not None}
    if q0.layout == "nk":  # back to [N, K] (load time: fusing and splitting are not per-call paths)
        leaves["values"] = leaves["values"].T
    return dataclasses.replace(q0, **leaves)


def fuse(values: Sequence[Any], parts: Sequence[Part], shards: int = 1) -> Any:
    """The parts' values [..., width_p] -> the fused value [..., fused_width] in the per-shard layout."""
    if len(values) != len(parts):
        raise ValueError(f"fuse: {len(values)} values for parts {[p.name for p in parts]}")
    for v, p in zip(values, parts):
        if v.shape[-1] != p.width:
            raise ValueError(f"{p.name}: {v.shape[-1]} output columns, expected {p.width}")

    def build(arrays):
        pieces = []
        for j in range(shards):
            for a, p in zip(arrays, parts):
                nb = p.blocks(shards)
                w, b = p.width // nb, j * nb // shards
                pieces.append(_cols(a, b * w, (b + 1) * w))
        return _cat(pieces)

    return _map_columns(values, build)


def split(value: Any, parts: Sequence[Part], shards: int = 1) -> list[Any]:
    """Inverse of `fuse`: the fused value -> each part's canonical value (a repeated unit read from its first shard)."""
    per = fused_width(parts, shards) // shards
    out = []
    offset = 0
    for p in parts:
        nb = p.blocks(shards)
        w = p.width // nb

        def take(arrays, offset=offset, nb=nb, w=w):
            (a,) = arrays
            first = [b * shards // nb for b in range(nb)]  # the first shard holding block b
            return _cat([_cols(a, j * per + offset, j * per + offset + w) for j in first])

        out.append(_map_columns([value], take))
        offset += w
    return out


def unfuse_output(y: jax.Array, parts: Sequence[Part], shards: int) -> list[jax.Array]:
    """The fused matmul's output [..., fused_width] -> each part's output [..., shards * w_p] (heads in order)."""
    per = fused_width(parts, shards) // shards
    y = y.reshape(*y.shape[:-1], shards, per)
    out, offset = [], 0
    for p in parts:
        w = p.width // p.blocks(shards)
        out.append(y[..., offset : offset + w].reshape(*y.shape[:-2], shards * w))
        offset += w
    return out


class PartSlot:
    """A canonical parameter's view of its fused slot: get_value / set_value / [...] like an nnx.Param.

    set_value rewrites the fused value with this part replaced (tests and old-style per-name writes; build_model
    and the engine's weight updates fuse all parts first and write the slot once)."""

    def __init__(self, param, parts: Sequence[Part], index: int, shards: int):
        self.param, self.parts, self.index, self.shards = param, tuple(parts), index, shards

    def get_value(self):
        value = self.param.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            shape = (*value.shape[:-1], self.parts[self.index].width)
            return jax.ShapeDtypeStruct(shape, value.dtype)
        return split(value, self.parts, self.shards)[self.index]

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("a fused parameter's part is read whole: slot[...]")
        return self.get_value()

    def set_value(self, value) -> None:
        values = split(self.param.get_value(), self.parts, self.shards)
        values[self.index] = value
        self.param.set_value(fuse(values, self.parts, self.shards))
