"""Sharded Orbax checkpoints on forced CPU devices, in a fresh 8-device process.

`checkpoints.convert --mesh tp=4,pp=2` puts every tensor into its tp=4 NamedSharding and saves; restoring onto
other meshes (tp=2, pp=2, tp=8, one device) reshards on read and gives back exactly the original parameters,
each already in the target mesh's sharding (orbax reads only the shards each device holds); on a pp mesh each
layer lands on its stage's devices only. The stored array metadata records the tp=4 sharding it was written with.
"""

from __future__ import annotations

import pytest

from tests.script_run import run_script

SCRIPT = r"""
import sys, tempfile, os
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
from checkpoints import orbax_io
from checkpoints.convert import convert, parse_mesh
from model.config import ModelConfig
from model.transformer import model_params, random_model
from sharding.mesh import ParallelConfig, make_mesh
from sharding.rules import param_shardings

cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=4, intermediate_size=128, vocab_size=256)
params = {k: np.asarray(v) for k, v in model_params(random_model(cfg, jnp.float32, seed=2)).items()}
root = tempfile.mkdtemp()
src, dst = os.path.join(root, "src"), os.path.join(root, "dst")
orbax_io.save(src, cfg, params)
convert(src, dst, mesh="tp=4,pp=2")
stored = ocp.PyTreeCheckpointer().metadata(os.path.join(dst, "params")).item_metadata.tree
print("stored sharding of wq:", getattr(stored["layers.0.wq"], "sharding", None))
for degrees in (dict(tp=2), dict(pp=2), dict(tp=8), dict(tp=2, pp=2), {}):
    parallel = ParallelConfig(**degrees)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.num_devices])
    config, restored, _ = orbax_io.restore(dst, mesh=mesh)
    assert config == cfg and set(restored) == set(params)
    want = param_shardings(params, mesh, head_dim=cfg.head_dim)
    for name, value in restored.items():
        assert isinstance(value, jax.Array) and value.sharding.is_equivalent_to(want[name], value.ndim), name
        np.testing.assert_array_equal(np.asarray(value), params[name])
    tp = parallel.tp
    wq = restored["layers.0.wq"]
    assert wq.sharding.shard_shape(wq.shape) == (cfg.hidden_size, cfg.q_size // tp), (degrees, wq.sharding)
    # pp: each layer is read onto its own stage's devices only (model/pipeline.py stacks them from there).
    for layer in range(cfg.num_layers):
        stage = layer * parallel.pp // cfg.num_layers
        stage_devices = set(mesh.devices[:, stage].flat)
        assert restored[f"layers.{layer}.wq"].sharding.device_set == stage_devices, (degrees, layer)
    assert restored["embed"].sharding.device_set == set(mesh.devices.flat)
for bad, message in (("tp=0", "is not"), ("xp=2", "is not"), ("tp=2,tp=2", "twice")):
    try:
        parse_mesh(bad)
    except ValueError as e:
        assert message in str(e), e
    else:
        raise AssertionError(bad)
try:
    convert(src, os.path.join(root, "big"), mesh="tp=16")
except ValueError as e:
    assert "needs 16 devices; 8 exist" in str(e), e
else:
    raise AssertionError("tp=16 accepted on 8 devices")
print("ok")
"""


@pytest.mark.slow
def test_convert_sharded_and_restore_on_other_meshes():
    run_script(SCRIPT, devices=8)
