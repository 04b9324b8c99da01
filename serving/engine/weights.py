"""Weights that a researcher holds, turned into the engine's: adoption at construction, swapping in place later.

    canonical dict {name: array | QuantizedArray}      nnx.State of a Transformer      a Transformer module
        --> canonical_params(...)                     one canonical dict (model/transformer.py names)
        --> matched(name, new, current)               cast to the slot's dtype, put on its sharding, re-quantised
                                                      when the slot holds a QuantizedArray
        --> state_like(graphdef, state, canonical)    an nnx.State with the runner's exact tree
        --> ModelRunner.set_params(state)             copied into the old buffers (donated): no recompilation,
                                                      no second copy of the weights

The engine always owns its buffers: `own()` copies jax arrays a caller passes in (host arrays are copied to the
device anyway), so a trainer may keep updating, donating or deleting its own arrays; `update_weights` then
copies into the engine's buffers in place.

Quantised slots: a float weight for a slot holding a QuantizedArray is re-quantised by round-to-nearest in the
format the slot holds (int8 / fp8 per channel or per tensor, int4 with its group size, symmetric or with zero
points; routed experts [E, K, N] expert by expert); a pre_scale (AWQ, SmoothQuant) and the activation format and
scale are kept, so the layout and the compiled steps stay the same. GPTQ's error compensation and AWQ's scale
search are not redone (they need calibration inputs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.quant import QuantizedArray, to_layout, with_stream_layout
from model.quant_methods import rtn
from model.quantize_model import rtn_experts
from model.transformer import Transformer, abstract_model, model_params, storage_value, write_params
from model.transformer import _param_slots as param_slots
from model.transformer import _storage_slots as storage_slots
from sharding.rules import param_shardings


def canonical_params(params: Any, cfg, dtype=jnp.float32) -> Mapping[str, Any]:
    """A canonical name -> value dict from a canonical mapping, an nnx.State of a Transformer of `cfg`, or a
    Transformer module.

    Raises:
      ValueError: a State or module whose tree is not that of a Transformer of `cfg`.
    """
    if isinstance(params, Transformer):
        return model_params(params)
    if isinstance(params, nnx.State):
        graphdef, _ = nnx.split(abstract_model(cfg, dtype))
        try:
            return model_params(nnx.merge(graphdef, params))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"params: an nnx.State that is not a {cfg.name} Transformer's ({e})") from e
    if isinstance(params, Mapping):
        return params  # may be lazy (checkpoints/lazy.py): read one tensor at a time, later
    raise ValueError(f"params must be a canonical dict, an nnx.State or a Transformer, got {type(params).__name__}")


@jax.jit
def _copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


class Owned(Mapping):
    """`params` read one value at a time, each jax array (QuantizedArray leaves included) copied on its own
    sharding; host arrays pass through (build_model copies them to the device), so a lazy mapping stays lazy."""

    def __init__(self, params: Mapping[str, Any]):
        self._params = params

    def __getitem__(self, name: str) -> Any:
        value = self._params[name]
        return _copy_tree(value) if isinstance(value, (QuantizedArray, jax.Array)) else value

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def own(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """See `Owned`."""
    return Owned(params)


def own_model(model: Transformer) -> Transformer:
    """A module of the same graph holding copies of `model`'s parameters (the caller keeps the original)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, _copy_tree(state))


def _requantize(name: str, w, like: QuantizedArray) -> QuantizedArray:
    """`w` (float [K, N], the logical weight) in the format and layout of `like` (see the module docstring)."""
    if like.values.ndim == 3:  # routed experts [E, K, N], weight-only: expert by expert, as quantize_model made them
        return _on_shardings(name, rtn_experts(w, like.fmt, like.group_size), like)
    w = jnp.asarray(w, jnp.float32)
    if like.pre_scale is not None:  # logical = pre_scale[:, None] * stored
        w = w / like.pre_scale.astype(jnp.float32)[:, None]
    if like.fmt == "int4":
        q = rtn(w, "int4", group_size=like.group_size, asymmetric=like.zeros is not None)
    else:
        q = rtn(w, like.fmt, per_tensor=like.fmt == "fp8" and like.scales.ndim == 0)
    # Copies of the kept leaves: the engine's own buffers would be donated and read in the same weight update.
    kept = {n: None if getattr(like, n) is None else jnp.copy(getattr(like, n)) for n in ("pre_scale", "act_scale")}
    q = dataclasses.replace(q, act_fmt=like.act_fmt, **kept)
    q = to_layout(q, like.layout)  # W8A8 weights are stored [N, K]
    if like.stream is not None:  # the streaming kernel's copy is rebuilt too (the compiled steps read it)
        q = with_stream_layout(q)
    return _on_shardings(name, q, like)


def _on_shardings(name: str, value, like):
    """Every leaf of `value` cast to the dtype of, and put on the sharding of, the matching leaf of `like`."""
    a, b = jax.tree.structure(value), jax.tree.structure(like)
    if a != b:
        raise ValueError(f"{name}: layout {a} differs from the engine's {b}")
    leaves = []
    for v, ref in zip(jax.tree.leaves(value), jax.tree.leaves(like)):
        if tuple(v.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: shape {tuple(v.shape)} != the engine's {tuple(ref.shape)}")
        v = v.astype(ref.dtype) if isinstance(v, jax.Array) else np.asarray(v).astype(ref.dtype, copy=False)
        leaves.append(jax.device_put(v, ref.sharding))
    return jax.tree.unflatten(b, leaves)


def matched(name: str, new: Any, current: Any) -> Any:
    """`new` for the slot that holds `current`: same shape, dtype, sharding and (quantised) layout.

    Raises:
      ValueError: a wrong shape, or a QuantizedArray for a float slot (that would change the compiled steps).
    """
    if tuple(new.shape) != tuple(current.shape):
        raise ValueError(f"{name}: shape {tuple(new.shape)} != the engine's {tuple(current.shape)}")
    if isinstance(current, QuantizedArray) and not isinstance(new, QuantizedArray):
        return _requantize(name, new, current)
    if isinstance(new, QuantizedArray) and not isinstance(current, QuantizedArray):
        raise ValueError(f"{name}: a QuantizedArray for a float parameter (the engine serves it unquantised)")
    return _on_shardings(name, new, current)


def _matched_into(module: Transformer, params: Mapping[str, Any]) -> None:
    """Every slot of `module` set to canonical `params` matched to what it holds (a fused slot: its parts
    concatenated in the slot's layout first, then matched, so a quantised fused slot is re-quantised whole)."""
    slots = param_slots(module)
    missing, extra = sorted(set(slots) - set(params)), sorted(set(params) - set(slots))
    if missing or extra:
        raise ValueError(f"params do not match the model: missing {missing[:6]}, unexpected {extra[:6]}")
    new = {}
    for name, slot in storage_slots(module).items():
        new[name] = matched(name, storage_value(module, name, params.__getitem__), slot.get_value())
    for name, slot in storage_slots(module).items():
        slot.set_value(new[name])


def state_like(graphdef, state: nnx.State, params: Mapping[str, Any]) -> nnx.State:
    """An nnx.State with `state`'s tree whose every parameter is `params[name]` matched to the current value.

    Raises:
      ValueError: missing or unknown names (all of the model's parameters must be given), bad shapes.
    """
    module = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # fresh Variables: `state` is not touched
    _matched_into(module, params)
    return nnx.split(module)[1]


@functools.partial(jax.jit, donate_argnums=(0,), keep_unused=True)
def _copy_into(old, new):
    """`new` copied into the buffers of `old` (donated; kept although unused, so XLA aliases them)."""
    return [jnp.copy(b) for b in new]


def swap_params(old: nnx.State, new: nnx.State) -> nnx.State:
    """`new` (the tree, shapes, dtypes and shardings of `old`) copied into `old`'s buffers, which are donated:
    memory does not grow, compiled steps take the result unchanged, and the caller keeps `new`.

    Raises:
      ValueError: a different tree, or a leaf of another shape, dtype or sharding.
    """
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise ValueError("set_params: params do not have the runner's parameter tree")
    for i, (a, b) in enumerate(zip(jax.tree.leaves(old), jax.tree.leaves(new))):
        if (a.shape, a.dtype) != (b.shape, b.dtype) or not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            raise ValueError(
                f"set_params: leaf {i} is {b.shape} {b.dtype} {b.sharding}, the runner's {a.shape} {a.dtype} {a.sharding}"
            )
    return jax.tree.unflatten(jax.tree.structure(old), _copy_into(jax.tree.leaves(old), jax.tree.leaves(new)))


def update_runner(runner, params: Mapping[str, Any]) -> None:
    """Swaps canonical `params` into a ModelRunner in place (see the module docstring)."""
    runner.set_params(state_like(runner.graphdef, runner.params, params))


def update_module(model: Transformer, params: Mapping[str, Any]) -> None:
    """Writes canonical `params` into `model`'s slots, matched to what each slot holds (no runner yet)."""
    _matched_into(model, own(params))


def place_on_mesh(model: Transformer, mesh) -> Transformer:
    """Every parameter of `model` put on `mesh` with its NamedSharding from sharding/rules.py, in place; fused
    slots are re-laid out per tensor-parallel shard (model/fused.py) so their column split keeps each shard's
    q/k/v heads and gate/up halves together. QuantizedArray leaves are replicated."""
    canonical = param_slots(model)
    shardings = param_shardings({n: s.get_value() for n, s in canonical.items()}, mesh, head_dim=model.cfg.head_dim)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # Views of the current layout, read before any slot is rewritten (a slot's parts are read, then it is written).
    return write_params(model, lambda n: canonical[n].get_value(), model.dtype, shardings, replicated)
