"""Model creation and loading: the quantised-weight door, abstract creation, one write per parameter, placement.

The SmolLM2 numbers themselves (GGUF -> logits within 1e-3 of HF transformers) are tests/test_oracle.py.
"""

import gc
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.lazy import LazyParams
from model.config import ModelConfig
from model.kv import NoCache
from model.quant import QuantizedArray
from model.transformer import Transformer, _param_slots, build_model, model_params, random_model
from tests.script_run import run_script

TOKENS = jnp.asarray([[5, 17, 300, 2, 9, 44, 7]])
POS = jnp.arange(7)[None]


@nnx.jit
def _forward(model, tokens, pos):
    return model(tokens, pos, None, NoCache(jnp.array([tokens.shape[1]])))[0]


def logits(model):
    return _forward(model, TOKENS, POS)


def host_params(cfg, seed=1, dtype=jnp.float32):
    return {k: np.asarray(v) for k, v in model_params(random_model(cfg, dtype, seed=seed)).items()}


def int8_per_channel(w: np.ndarray) -> QuantizedArray:
    """Symmetric per-output-channel int8 of a [K, N] weight, built here (not by the library's quantisers)."""
    scales = np.maximum(np.abs(w).max(axis=0), 1e-8) / 127.0
    values = np.clip(np.round(w / scales), -127, 127).astype(np.int8)
    return QuantizedArray(jnp.asarray(values), jnp.asarray(scales, jnp.float32), fmt="int8")


# Whole fused groups (q|k|v, gate|up: model/fused.py) quantised, so each stays one QuantizedArray; layers.1.wq
# alone (MIXED) is a group of a quantised and float parts, which is stored as float (the same logical weights).
QUANTISED = (
    "layers.0.wq", "layers.0.wk", "layers.0.wv", "layers.1.wo", "layers.0.w_gate", "layers.0.w_up",
    "layers.1.w_down", "lm_head",
)  # fmt: skip
QUANTISED_SLOTS = 5  # layers.0.wqkv, layers.1.wo, layers.0.gate_up, layers.1.w_down, lm_head
MIXED = ("layers.1.wq",)


def test_quantised_weights_enter_through_the_door():
    cfg = ModelConfig.tiny()  # Untied: the LM head is a projection too.
    assert not cfg.tie_word_embeddings
    params = host_params(cfg)
    quantised = {n: int8_per_channel(params[n]) for n in QUANTISED + MIXED}
    dequantised = {n: np.asarray(q.dequantize(jnp.float32)) for n, q in quantised.items()}
    model_q = build_model(cfg, {**params, **quantised})
    model_d = build_model(cfg, {**params, **dequantised})
    want = logits(model_d)
    np.testing.assert_allclose(logits(model_q), want, rtol=1e-5, atol=1e-5)
    # Quantisation really changed the weights (so the comparison above is not trivially plain-vs-plain).
    assert float(jnp.max(jnp.abs(logits(build_model(cfg, params)) - want))) > 1e-4

    # The pytree lives in the Param: canonical names, split / merge, jit all see it.
    got = model_params(model_q)
    assert all(isinstance(got[n], QuantizedArray) for n in QUANTISED)
    assert got["layers.0.wq"].values.dtype == jnp.int8 and isinstance(got["layers.1.wk"], jax.Array)
    assert isinstance(got["layers.1.wq"], jax.Array)  # MIXED: dequantised into the float fused slot
    graphdef, state = nnx.split(model_q)
    assert sum(x.dtype == jnp.int8 for x in jax.tree.leaves(state)) == QUANTISED_SLOTS
    np.testing.assert_allclose(logits(nnx.merge(graphdef, state)), want, rtol=1e-5, atol=1e-5)
    jitted = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p, None, NoCache(jnp.array([7])))[0])
    np.testing.assert_allclose(jitted(state, TOKENS, POS), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits(build_model(cfg, got)), want, rtol=1e-5, atol=1e-5)  # Round trip.


def test_quantised_parameter_errors():
    cfg = ModelConfig.tiny()
    params = host_params(cfg)
    with pytest.raises(ValueError, match="only linear weights"):
        build_model(cfg, dict(params, embed=int8_per_channel(params["embed"])))
    with pytest.raises(ValueError, match="layers.0.wq: shape"):
        build_model(cfg, dict(params, **{"layers.0.wq": int8_per_channel(params["layers.0.wk"])}))


def old_build_model(cfg, params, dtype):
    """The build path this module replaced: a model of zeros / ones, then every slot overwritten."""
    model = Transformer(cfg, dtype=dtype, rngs=None)
    for name, slot in _param_slots(model).items():
        slot.set_value(jnp.asarray(np.asarray(params[name]), dtype))
    return model


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_plain_weights_unchanged_by_the_door(dtype):
    cfg = ModelConfig.tiny(attention_bias=True)
    params = host_params(cfg)
    new = build_model(cfg, params, dtype)
    assert all(v.dtype == dtype for v in model_params(new).values())
    np.testing.assert_array_equal(logits(new), logits(old_build_model(cfg, params, dtype)))
    np.testing.assert_array_equal(logits(build_model(cfg, jax.tree.map(jnp.asarray, params), dtype)), logits(new))


class RecordingParams(LazyParams):
    """Records, at each read, how many bytes of device arrays are alive beyond a baseline."""

    def __init__(self, params):
        super().__init__(
            {k: (lambda v=v: v.copy()) for k, v in params.items()}, {k: v.shape for k, v in params.items()}
        )
        self.seen = []

    def __getitem__(self, name):
        live = sum(x.nbytes for x in jax.live_arrays())
        self.seen.append((name, live))
        return super().__getitem__(name)


def test_build_model_allocates_only_written_parameters():
    cfg = ModelConfig.tiny().replace(hidden_size=128, intermediate_size=384, vocab_size=2048)
    params = host_params(cfg)
    recording = RecordingParams(params)
    gc.collect()
    baseline = sum(x.nbytes for x in jax.live_arrays())
    model = build_model(cfg, recording, jnp.bfloat16)
    total = sum(v.size * 2 for v in params.values())
    assert [n for n, _ in recording.seen] == list(_param_slots(model)) and recording.reads == len(params)
    written = 0
    for name, live in recording.seen:
        # Before a tensor is read, only the tensors already written exist: no zero-filled model (old code: the
        # first read already saw `total` bytes of zeros and ones).
        assert live - baseline <= written + 1024, (name, live - baseline, written, total)
        written += params[name].size * 2
    assert written == total
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(model)))


def test_random_model_init_per_parameter():
    cfg = ModelConfig.tiny(attention_bias=True)
    a = model_params(random_model(cfg, jnp.bfloat16, seed=3))
    b = model_params(random_model(cfg, jnp.bfloat16, seed=3))
    c = model_params(random_model(cfg, jnp.bfloat16, seed=4))
    assert all(v.dtype == jnp.bfloat16 for v in a.values())
    assert all(np.array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)) for k in a)
    assert not np.array_equal(np.asarray(a["layers.0.wq"], np.float32), np.asarray(c["layers.0.wq"], np.float32))
    assert not np.array_equal(np.asarray(a["layers.0.wq"], np.float32), np.asarray(a["layers.1.wq"], np.float32))
    np.testing.assert_array_equal(np.asarray(a["layers.1.mlp_norm"], np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(a["layers.0.bk"], np.float32), 0.0)
    w_down = np.asarray(a["layers.0.w_down"], np.float32)
    assert abs(w_down.std() * np.sqrt(cfg.intermediate_size) - 1.0) < 0.1
    assert abs(np.asarray(a["embed"], np.float32).std() - 1.0) < 0.1


def test_default_gguf_is_read_lazily_once_per_tensor():
    from checkpoints.gguf import load_gguf
    from checkpoints.loader import default_model_path, load_checkpoint

    ckpt = load_checkpoint(None)
    assert isinstance(ckpt.params, LazyParams) and ckpt.params.reads == 0
    assert ckpt.params.shape("layers.0.wq") == (576, 576)
    model = build_model(ckpt.config, ckpt.params, jnp.bfloat16)
    assert ckpt.params.reads == len(ckpt.params)
    eager = load_gguf(default_model_path())[1]
    for name in ("layers.3.wk", "layers.29.w_down", "embed"):
        np.testing.assert_array_equal(np.asarray(model_params(model)[name]), eager[name].astype(jnp.bfloat16))


SHARDED_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from model.config import ModelConfig
    from model.kv import NoCache
    from model.transformer import _storage_slots, build_model, model_params, random_model
    from sharding.mesh import ParallelConfig, make_mesh
    from sharding.rules import param_shardings

    assert len(jax.devices()) == 8
    cfg = ModelConfig.tiny()
    mesh = make_mesh(ParallelConfig(tp=2, dp=4), jax.devices())
    params = {k: np.asarray(v) for k, v in model_params(random_model(cfg, seed=5)).items()}
    shardings = param_shardings(params, mesh, head_dim=cfg.head_dim)
    assert any(len(s.spec) and any(a is not None for a in s.spec) for s in shardings.values())
    for made in (build_model(cfg, params, shardings=shardings), random_model(cfg, seed=5, shardings=shardings)):
        placed = model_params(made)
        for name, value in placed.items():
            np.testing.assert_array_equal(np.asarray(value), params[name])
        for name, slot in _storage_slots(made).items():
            value = slot.get_value()
            first = {"wqkv": "wq", "bqkv": "bq", "gate_up": "w_gate"}.get(name.rsplit(".", 1)[-1])
            want = shardings[name if first is None else name.rsplit(".", 1)[0] + "." + first]
            assert value.sharding.is_equivalent_to(want, value.ndim), name
        # Fused q|k|v split over tp = 2 in the per-shard layout: each device holds its own q, k and v heads.
        wqkv = _storage_slots(made)["layers.0.wqkv"].get_value()
        q, k, v = (params["layers.0." + n] for n in ("wq", "wk", "wv"))
        for shard in wqkv.addressable_shards:
            j = shard.index[1].start // (wqkv.shape[1] // 2)
            cols = lambda w: w[:, j * w.shape[1] // 2 : (j + 1) * w.shape[1] // 2]
            np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate([cols(q), cols(k), cols(v)], 1))
    tokens, pos = jnp.asarray([[5, 17, 30, 2]]), jnp.arange(4)[None]
    run = nnx.jit(lambda m: m(tokens, pos, None, NoCache(jnp.array([4])))[0])
    np.testing.assert_allclose(np.asarray(run(made)), np.asarray(run(build_model(cfg, params))), rtol=1e-5, atol=1e-5)
    print("ok")
    """
)


def test_shardings_place_each_parameter():
    run_script(SHARDED_SCRIPT, devices=8, timeout=300, env={"JAX_PLATFORMS": "cpu"})


def test_shardings_naming_unknown_parameters_raise():
    cfg = ModelConfig.tiny()
    params = host_params(cfg)
    with pytest.raises(ValueError, match="shardings name parameters"):
        build_model(cfg, params, shardings={"layers.9.wq": None})
    with pytest.raises(ValueError, match="shardings name parameters"):
        random_model(cfg, shardings={"nope": None})


def test_orbax_checkpoint_is_read_lazily(tmp_path):
    from checkpoints import orbax_io
    from checkpoints.loader import load_checkpoint

    cfg = ModelConfig.tiny()
    params = host_params(cfg, seed=6)
    orbax_io.save(str(tmp_path / "ckpt"), cfg, params)
    ckpt = load_checkpoint(str(tmp_path / "ckpt"))
    assert isinstance(ckpt.params, LazyParams) and ckpt.params.reads == 0
    model = build_model(ckpt.config, ckpt.params, jnp.bfloat16)
    assert ckpt.params.reads == len(params)
    for name, value in model_params(model).items():
        np.testing.assert_array_equal(np.asarray(value), params[name].astype(jnp.bfloat16), err_msg=name)


def test_hf_checkpoint_is_read_lazily(tmp_path):
    import json

    from safetensors.numpy import save_file

    from checkpoints import hf
    from checkpoints.loader import load_checkpoint

    cfg = ModelConfig.tiny()
    params = host_params(cfg, seed=7)
    to_hf = {canon: (name, t) for name, (canon, t) in hf._GLOBAL_TENSORS.items()}
    for i in range(cfg.num_layers):
        to_hf.update({f"layers.{i}.{c}": (f"model.layers.{i}.{n}", t) for n, (c, t) in hf._LAYER_TENSORS.items()})
    save_file(
        {to_hf[k][0]: np.ascontiguousarray(v.T if to_hf[k][1] else v) for k, v in params.items()},
        str(tmp_path / "model.safetensors"),
    )
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    ckpt = load_checkpoint(str(tmp_path))
    assert isinstance(ckpt.params, LazyParams) and ckpt.params.reads == 0
    model = build_model(ckpt.config, ckpt.params)
    assert ckpt.params.reads == len(params)
    for name, value in model_params(model).items():
        np.testing.assert_array_equal(np.asarray(value), params[name], err_msg=name)
