"""Meshes and sharding rules on 8 forced CPU devices.

XLA_FLAGS must be set before JAX creates its CPU backend. Setting it at import (collection time) is early enough
when this module is collected first; when an earlier module already started JAX (e.g. a GPU probe at import),
every test here is skipped in-process and `test_module_in_fresh_process` runs this whole file in a new process
with the flag set, so the work is still done and its failures still fail the run.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P

from checkpoints.gguf import expected_shapes  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from sharding import mesh as mesh_lib  # noqa: E402
from sharding import rules  # noqa: E402
from sharding.mesh import ParallelConfig, make_mesh  # noqa: E402

# Starts JAX's backend now if nobody has: with the flag above it then has 8 CPU devices.
HAS_8_CPU_DEVICES = len(jax.devices("cpu")) >= 8
FRESH_PROCESS_TEST = "test_module_in_fresh_process"


def run_in_fresh_process(module_file: str) -> None:
    """Runs the pytest module `module_file` in a new process with 8 forced CPU devices; fails on any failure."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(module_file))),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.fixture(autouse=True)
def eight_devices(request):
    """Skips in-process tests when JAX started too early; FRESH_PROCESS_TEST then runs them (see docstring)."""
    if request.node.name == FRESH_PROCESS_TEST:
        if HAS_8_CPU_DEVICES:
            pytest.skip("this process has 8 CPU devices; the tests ran in-process")
    elif not HAS_8_CPU_DEVICES:
        pytest.skip(f"JAX started with fewer than 8 CPU devices; {FRESH_PROCESS_TEST} runs this test")


def test_module_in_fresh_process():
    run_in_fresh_process(__file__)


def cpu_mesh(**degrees) -> jax.sharding.Mesh:
    parallel = ParallelConfig(**degrees)
    return make_mesh(parallel, jax.devices("cpu")[: parallel.num_devices])


@pytest.mark.parametrize(
    "degrees", [{}, {"tp": 2}, {"dp": 2, "tp": 2}, {"tp": 8}, {"dp": 2, "tp": 4}, {"dp": 2, "pp": 2, "ep": 1, "tp": 2}]
)
def test_make_mesh(degrees):
    mesh = cpu_mesh(**degrees)
    parallel = ParallelConfig(**degrees)
    assert mesh.axis_names == mesh_lib.MESH_AXES
    assert dict(mesh.shape) == {
        "data": parallel.dp,
        "pipeline": parallel.pp,
        "expert": parallel.ep,
        "tensor": parallel.tp,
    }
    assert mesh.devices.size == parallel.num_devices
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_parallel_config_and_mesh_errors():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="needs 4 devices; 8 given"):
        make_mesh(ParallelConfig(tp=4), jax.devices("cpu")[:8])
    assert make_mesh(ParallelConfig(dp=2, tp=4)).devices.size == len(jax.devices())


def test_initialize_distributed_single_process_is_noop():
    assert mesh_lib.initialize_distributed() is False
    assert mesh_lib.initialize_distributed(num_processes=1) is False


def expected_spec(name: str, config: ModelConfig, tp: int) -> P:
    """The spec the rules should give, written out by hand: Megatron column/row splits, heads counted whole."""
    key = name.split(".")[-1]
    splits = {
        "q": config.num_heads % tp == 0,
        "kv": config.num_kv_heads % tp == 0,
        "mlp": config.intermediate_size % tp == 0,
        "vocab": config.vocab_size % tp == 0,
    }
    t = lambda ok: "tensor" if ok and tp > 1 else None  # noqa: E731
    table = {
        "embed": P(t(splits["vocab"]), None),
        "lm_head": P(None, t(splits["vocab"])),
        "final_norm": P(None),
        "attn_norm": P(None),
        "mlp_norm": P(None),
        "wq": P(None, t(splits["q"])),
        "wk": P(None, t(splits["kv"])),
        "wv": P(None, t(splits["kv"])),
        "wo": P(t(splits["q"]), None),
        "w_gate": P(None, t(splits["mlp"])),
        "w_up": P(None, t(splits["mlp"])),
        "w_down": P(t(splits["mlp"]), None),
        "bq": P(t(splits["q"])),
        "bk": P(t(splits["kv"])),
        "bv": P(t(splits["kv"])),
    }
    return table[key]


@pytest.mark.parametrize(
    "config",
    [ModelConfig.tiny(attention_bias=True), ModelConfig.llama3_8b(), ModelConfig.smollm2_135m()],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_param_specs_every_canonical_param(config, tp):
    mesh = cpu_mesh(tp=tp)
    shapes = expected_shapes(config)
    shardings = rules.param_shardings(shapes, mesh, head_dim=config.head_dim)
    assert set(shardings) == set(shapes)
    for name, shape in shapes.items():
        assert shardings[name].spec == expected_spec(name, config, tp), (name, shape)
        assert shardings[name].mesh == mesh
        shardings[name].shard_shape(shape)  # Raises if a sharded dimension does not divide.


def test_divisibility_fallback():
    mesh = cpu_mesh(tp=2)
    # SmolLM2: 3 KV heads of 64 -> 192 columns divide by 2 but the heads do not: replicate with head_dim.
    assert rules.param_partition_spec("layers.0.wk", (576, 192), mesh, head_dim=64) == P(None, None)
    assert rules.param_partition_spec("layers.0.wk", (576, 192), mesh) == P(None, "tensor")
    assert rules.param_partition_spec("layers.0.wq", (576, 576), mesh, head_dim=64) == P(None, None)
    # An odd vocabulary stays whole; the other dimension keeps its (replicated) spec.
    mesh8 = cpu_mesh(tp=8)
    assert rules.param_partition_spec("embed", (32001, 64), mesh8) == P(None, None)
    assert rules.param_partition_spec("layers.0.w_down", (100, 64), mesh8) == P(None, None)
    assert rules.param_partition_spec("layers.0.w_down", (96, 64), mesh8) == P("tensor", None)


def test_stacked_params_and_name_errors():
    mesh = cpu_mesh(tp=4)
    assert rules.param_partition_spec("layers.0.wq", (2, 64, 64), mesh, head_dim=16) == P(None, None, "tensor")
    for bad in ["wq", "layers.0.embed", "layers.x.wq", "layers.0.wq.bias", "lm_head.weight"]:
        with pytest.raises(ValueError, match="not a canonical parameter"):
            rules.param_logical_axes(bad)
    with pytest.raises(ValueError, match="has 4 dims"):
        rules.param_partition_spec("layers.0.wq", (1, 2, 64, 64), mesh)
    with pytest.raises(ValueError, match="no rule"):
        rules.logical_partition_spec(("heads",), (8,), mesh)


def test_kv_cache_sharding():
    mesh = cpu_mesh(dp=2, tp=4)
    assert rules.kv_cache_sharding((8, 100, 16, 128), mesh).spec == P("tensor", None, None, None)
    assert rules.kv_cache_sharding((8, 100, 16), mesh).spec == P("tensor", None, None)
    assert rules.kv_cache_sharding((3, 100, 16, 64), mesh).spec == P(None, None, None, None)
    with pytest.raises(ValueError, match="4-D"):
        rules.kv_cache_sharding((8, 100), mesh)


def test_sharded_mlp_matches_unsharded():
    """Column-split w_gate/w_up and row-split w_down compute the same MLP as replicated weights."""
    config = ModelConfig.tiny()
    rng = np.random.default_rng(0)
    params = {
        n: (0.1 * rng.standard_normal(s)).astype(np.float32)
        for n, s in expected_shapes(config).items()
        if n.startswith("layers.0.w_")
    }
    mesh = cpu_mesh(dp=2, tp=4)
    sharded = rules.shard_params(params, mesh, head_dim=config.head_dim)
    assert sharded["layers.0.w_up"].addressable_shards[0].data.shape == (64, 24)
    assert sharded["layers.0.w_down"].addressable_shards[0].data.shape == (24, 64)

    @jax.jit
    def mlp(p, x):  # [T, D] -> [T, D]
        return (jax.nn.silu(x @ p["layers.0.w_gate"]) * (x @ p["layers.0.w_up"])) @ p["layers.0.w_down"]

    x = jnp.asarray(rng.standard_normal((5, config.hidden_size)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(mlp(sharded, x), mlp(params, x), rtol=1e-5, atol=1e-5)


def _int8_pages(rng, num_kv_heads, num_pages, page_size, head_dim):
    """int8 pages with per-token-per-head float32 scales ([Hkv, P, ps])."""
    values = rng.integers(-127, 128, (num_kv_heads, num_pages, page_size, head_dim)).astype(np.int8)
    scales = rng.uniform(0.005, 0.02, (num_kv_heads, num_pages, page_size)).astype(np.float32)
    return jnp.asarray(values), jnp.asarray(scales)


@pytest.mark.parametrize("kernel", ["paged", "ragged"])
def test_attention_kernels_with_kv_heads_sharded(kernel):
    """The page layout [Hkv, P, ps, D] (+ scales [Hkv, P, ps]) shards KV heads across devices: each device runs our
    kernel (Pallas interpreter) on its own heads, with no communication, and the result equals the unsharded
    reference. tp=4 over Hkv=4 / Hq=8 (GQA 2), int8 pages with per-token scales, shuffled block tables."""
    from pallas_kernels import paged_attention as pa
    from pallas_kernels import ragged_paged_attention as rpa

    rng = np.random.default_rng(3)
    hq, hkv, d, ps, num_pages = 8, 4, 64, 16, 24
    mesh = cpu_mesh(tp=4)
    k_pages, k_scales = _int8_pages(rng, hkv, num_pages, ps, d)
    v_pages, v_scales = _int8_pages(rng, hkv, num_pages, ps, d)
    block_tables = jnp.asarray(rng.permutation(num_pages)[: 3 * 8].reshape(3, 8), jnp.int32)
    kv_lens = jnp.asarray([37, 1, 128], jnp.int32)
    page_spec, head_spec = rules.kv_cache_sharding(k_pages.shape, mesh).spec, P(None, "tensor", None)
    scale_spec = rules.kv_cache_sharding(k_scales.shape, mesh).spec
    assert page_spec == P("tensor", None, None, None) and scale_spec == P("tensor", None, None)
    if kernel == "paged":
        q = jnp.asarray(rng.standard_normal((3, hq, d)), jnp.float32)
        extra = (block_tables, kv_lens)
        fn, ref_fn = pa.paged_attention, pa.reference
    else:  # a 5-token chunk ending at 37, a decode row, a 3-token chunk ending at 128, 2 padding tokens
        cu = jnp.asarray([0, 5, 6, 9], jnp.int32)
        q = jnp.asarray(rng.standard_normal((11, hq, d)), jnp.float32)
        extra = (block_tables, kv_lens, cu, jnp.int32(3))
        fn, ref_fn = rpa.ragged_paged_attention, rpa.reference

    def per_device(q, k, v, ks, vs, *rest):
        return fn(q, k, v, *rest, k_scales=ks, v_scales=vs, backend="interpret")

    sharded = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(head_spec, page_spec, page_spec, scale_spec, scale_spec) + (P(),) * len(extra),
            out_specs=head_spec,
        )
    )
    put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    out = sharded(
        put(q, head_spec),
        put(k_pages, page_spec),
        put(v_pages, page_spec),
        put(k_scales, scale_spec),
        put(v_scales, scale_spec),
        *extra,
    )
    assert out.sharding.spec == head_spec
    live = slice(None) if kernel == "paged" else slice(0, 9)
    out = np.asarray(out)[live]
    whole = fn(q, k_pages, v_pages, *extra, k_scales=k_scales, v_scales=v_scales, backend="interpret")
    np.testing.assert_allclose(out, np.asarray(whole)[live], rtol=1e-6, atol=1e-6)  # same kernel, per-head work
    ref = np.asarray(ref_fn(q, k_pages, v_pages, *extra, k_scales=k_scales, v_scales=v_scales))[live]
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2  # int8 pages dequantised to bf16 for the MMAs


def test_flash_attention_and_grads_with_heads_sharded():
    """flash_attention (Pallas interpreter) inside jax.shard_map with query and KV heads split over tp=4: forward and
    gradients equal the unsharded kernel's.

    The forward runs with shard_map's default check_vma=True (the kernels declare how their outputs vary over manual
    mesh axes). The gradients run with check_vma=False: jax 0.11.2's Pallas HLO interpreter evaluates the backward
    kernels' bodies without inserting varying-axis casts ("Primitive mul requires varying manual axes to match"),
    an interpreter limitation that the compiled GPU kernels do not have.
    """
    from pallas_kernels.flash_attention import flash_attention

    rng = np.random.default_rng(5)
    mesh = cpu_mesh(tp=4)
    q = jnp.asarray(rng.standard_normal((2, 40, 8, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 40, 4, 64)), jnp.float32) for _ in range(2))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    spec = P(None, None, "tensor", None)
    put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731

    def forward(q, k, v):
        return flash_attention(q, k, v, causal=True, backend="interpret")

    def grads(q, k, v, do):  # per device: its own heads' share of the loss
        return jax.grad(lambda *a: jnp.sum(forward(*a) * do), argnums=(0, 1, 2))(q, k, v)

    out = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(put(q), put(k), put(v))
    got = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3, check_vma=False))(
        put(q), put(k), put(v), put(do)
    )
    for g, w in zip((out,) + got, (forward(q, k, v),) + grads(q, k, v, do)):
        assert g.sharding.spec == spec
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
