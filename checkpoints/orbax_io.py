"""Orbax checkpoints: our native format, restored straight onto a device mesh.

Directory layout:

    DIR/
      config.json              ModelConfig.to_json()
      params/                  orbax PyTree checkpoint of the flat canonical dict ("layers.0.wq": [D, Hq*hd], ...)
      tokenizer.json           } Tokenizer.save(), when the checkpoint has a tokenizer
      tokenizer_config.json    }
      quantization.json        name -> {fmt, group_size, act_fmt, layout, leaves, shape} of QuantizedArray weights, whose
                               arrays are stored as "NAME.q_values", "NAME.q_scales", ... (absent: none quantised)

Restoring with a mesh hands orbax one ArrayRestoreArgs per array carrying its NamedSharding from
sharding/rules.py, so every host reads only the shards its devices hold; nothing is materialised on one device
and then redistributed. Without a mesh, arrays come back as host numpy arrays (the loaders' common currency),
all at once or, with `lazy=True`, one per access (a LazyParams, as the GGUF and HF loaders give).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from checkpoints.gguf import check_params, expected_shapes
from checkpoints.lazy import LazyParams
from model.config import ModelConfig
from model.quant import QuantizedArray
from sharding.rules import param_shardings

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
QUANT_FILE = "quantization.json"
_QUANT_SEP = ".q_"
_QUANT_LEAVES = ("values", "scales", "zeros", "pre_scale", "act_scale")
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")


def is_orbax_dir(path: str) -> bool:
    """True when `path` holds a checkpoint written by `save` (config.json plus an orbax params/ directory)."""
    params_dir = os.path.join(path, PARAMS_DIR)
    return (
        os.path.isfile(os.path.join(path, CONFIG_FILE))
        and os.path.isdir(params_dir)
        and any(os.path.exists(os.path.join(params_dir, m)) for m in _ORBAX_MARKERS)
    )


def _clear(directory: str, overwrite: bool) -> None:
    """Makes `directory` ready for a new checkpoint; only ever deletes a previous checkpoint of ours."""
    if not os.path.exists(directory) or (os.path.isdir(directory) and not os.listdir(directory)):
        return
    if not overwrite:
        raise FileExistsError(f"{directory} already exists (pass overwrite=True to replace it)")
    if not is_orbax_dir(directory):
        raise FileExistsError(f"{directory} exists and is not an Orbax checkpoint of ours; refusing to delete it")
    shutil.rmtree(directory)


def save(
    directory: str, config: ModelConfig, params: dict[str, Any], tokenizer=None, *, overwrite: bool = False
) -> None:
    """Writes params (numpy or jax arrays, possibly sharded), config.json and the tokenizer files.

    Args:
        directory: destination; created if needed.
        config: the model configuration, stored as config.json.
        params: canonical flat dict; its dtypes are kept.
        tokenizer: a checkpoints.tokenizer.Tokenizer, or None.
        overwrite: replace an existing checkpoint at `directory`.

    Raises:
        FileExistsError: `directory` is not empty and overwrite is False (or it is not a checkpoint of ours).
        ValueError: params do not match the config.
    """
    check_params(params, config)
    extra = sorted(set(params) - set(expected_shapes(config)))
    if extra:
        raise ValueError(f"params not in the config's canonical set: {extra[:8]}")
    directory = os.path.abspath(directory)
    _clear(directory, overwrite)
    os.makedirs(directory, exist_ok=True)
    # Orbax writes to a temporary name and renames on commit, so a crash leaves no half-written params/.
    flat, quantized = _flatten_quantized(params)
    ocp.PyTreeCheckpointer().save(os.path.join(directory, PARAMS_DIR), flat)
    if jax.process_index() == 0:
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            f.write(config.to_json())
        if quantized:
            with open(os.path.join(directory, QUANT_FILE), "w") as f:
                json.dump(quantized, f, indent=1, sort_keys=True)
        if tokenizer is not None:
            tokenizer.save(directory)


def _flatten_quantized(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict]]:
    """QuantizedArray values -> their arrays under "NAME.q_<leaf>" plus the static description of each."""
    flat, quantized = {}, {}
    for name, value in params.items():
        if not isinstance(value, QuantizedArray):
            flat[name] = value
            continue
        leaves = [leaf for leaf in _QUANT_LEAVES if getattr(value, leaf) is not None]
        quantized[name] = dict(
            fmt=value.fmt,
            group_size=value.group_size,
            act_fmt=value.act_fmt,
            layout=value.layout,
            leaves=leaves,
            shape=list(value.shape),
        )
        flat.update({name + _QUANT_SEP + leaf: getattr(value, leaf) for leaf in leaves})
    return flat, quantized


def _restore_quantized(checkpointer, params_dir: str, name: str, desc: dict) -> QuantizedArray:
    """One QuantizedArray: its arrays in one partial restore (stored dtypes kept: codes, float32 scales)."""
    keys = {leaf: name + _QUANT_SEP + leaf for leaf in desc["leaves"]}
    args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys.values()}
    restored = checkpointer.restore(
        params_dir,
        args=ocp.args.PyTreeRestore(item={k: 0 for k in keys.values()}, restore_args=args, partial_restore=True),
    )
    arrays = {leaf: jnp.asarray(restored[k]) for leaf, k in keys.items()}
    layout = desc.get("layout", "kn")  # checkpoints written before W8A8 weights were stored [N, K] have none
    return QuantizedArray(
        **arrays, fmt=desc["fmt"], group_size=desc["group_size"], act_fmt=desc["act_fmt"], layout=layout
    )


def load_config(directory: str) -> ModelConfig:
    """Reads the ModelConfig of a checkpoint written by `save`."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        return ModelConfig.from_json(f.read())


def _restore_one(checkpointer, params_dir: str, name: str, dtype: Any) -> np.ndarray:
    """One array of the checkpoint, read to the host (orbax partial restore)."""
    args = {name: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)}
    restored = checkpointer.restore(
        params_dir, args=ocp.args.PyTreeRestore(item={name: 0}, restore_args=args, partial_restore=True)
    )
    return restored[name]


def _read_params(checkpointer, params_dir: str, stored, config: ModelConfig, mesh, dtype, lazy: bool, quantized):
    """The arrays: lazily to the host, all to the host, or each into its NamedSharding on `mesh`. `quantized`
    weights come back as QuantizedArray (never cast; on the default device, as the runner replicates them)."""
    cast = None if dtype is None else jnp.dtype(dtype)
    quant = {k: functools.partial(_restore_quantized, checkpointer, params_dir, k, d) for k, d in quantized.items()}
    if lazy and mesh is None:
        loaders = {k: functools.partial(_restore_one, checkpointer, params_dir, k, cast) for k in stored} | quant
        shapes = {k: tuple(m.shape) for k, m in stored.items()} | {k: tuple(d["shape"]) for k, d in quantized.items()}
        return LazyParams(loaders, shapes)
    if not stored:
        return {k: load() for k, load in quant.items()}
    if mesh is None:
        args = {k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=cast) for k in stored}
    else:
        shardings = param_shardings({k: tuple(m.shape) for k, m in stored.items()}, mesh, head_dim=config.head_dim)
        args = {k: ocp.ArrayRestoreArgs(sharding=shardings[k], dtype=cast) for k in stored}
    item = {k: 0 for k in stored}
    restore_args = ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True) if quant else None
    restored = checkpointer.restore(params_dir, args=restore_args or ocp.args.PyTreeRestore(restore_args=args))
    return dict(restored) | {k: load() for k, load in quant.items()}


def restore(
    directory: str, mesh: Mesh | None = None, dtype: Any = None, *, lazy: bool = False
) -> tuple[ModelConfig, Mapping[str, Any], Any]:
    """Restores (config, params, tokenizer) from a checkpoint written by `save`.

    Args:
        directory: the checkpoint directory.
        mesh: when given, each array is read directly into its NamedSharding (sharding/rules.py) on this mesh
            and comes back as a jax.Array; when None, arrays come back as numpy on the host.
        dtype: cast to this dtype while reading (e.g. jnp.bfloat16); None keeps the stored dtype.
        lazy: without a mesh, return a checkpoints.lazy.LazyParams that reads one array per access (so a model
            build holds one host array at a time) instead of a dict of all of them.

    Returns:
        (config, canonical params, Tokenizer or None).

    Raises:
        ValueError: not a checkpoint of ours, or stored arrays that do not match config.json.
    """
    directory = os.path.abspath(directory)
    if not is_orbax_dir(directory):
        raise ValueError(f"{directory} is not an Orbax checkpoint (expected {CONFIG_FILE} and {PARAMS_DIR}/)")
    config = load_config(directory)
    params_dir = os.path.join(directory, PARAMS_DIR)
    checkpointer = ocp.PyTreeCheckpointer()
    stored = checkpointer.metadata(params_dir).item_metadata.tree  # name -> ArrayMetadata (shape, dtype)
    quantized = {}
    if os.path.isfile(os.path.join(directory, QUANT_FILE)):
        with open(os.path.join(directory, QUANT_FILE)) as f:
            quantized = json.load(f)
    stored = {k: m for k, m in stored.items() if k.split(_QUANT_SEP)[0] not in quantized}
    shapes = {k: tuple(m.shape) for k, m in stored.items()} | {k: tuple(d["shape"]) for k, d in quantized.items()}
    expected = expected_shapes(config)
    problems = sorted(set(expected) ^ set(shapes))
    problems += [f"{k}: {s} != {expected[k]}" for k, s in shapes.items() if k in expected and s != expected[k]]
    if problems:
        raise ValueError(f"{directory}: stored params do not match config.json: {problems[:8]}")
    params = _read_params(checkpointer, params_dir, stored, config, mesh, dtype, lazy, quantized)
    tokenizer = None
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        from checkpoints.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(directory)
    return config, params, tokenizer
