"""Quantised routed experts (model/moe.py `quantized_expert_matmul`, model/quantize_model.py `quantize_experts`).

* The grouped matmul over stacked QuantizedArrays [E, K, N] (int8 and fp8 per channel or per tensor, int4 in
  groups, symmetric or with zero points, grouped int8) equals ragged_dot over the dequantised experts, in float32,
  on ragged group sizes with empty groups, sizes that divide nothing, and rows past the groups.
* An MoE block with quantised experts equals the same block holding the dequantised float experts: Qwen-MoE's
  shared expert, gpt-oss's biases, clamped SwiGLU and top-k-then-softmax routing.
* Through the engine, `LLM(path, quantization=m)` on the tiny Qwen3-MoE, gpt-oss and DeepSeek-V2 checkpoints of
  tests/data/hf_tiny stores the experts quantised (codes at 1 or 1/2 byte a weight), counts them in the log line,
  serves exactly the quantised model's logits (the same model with every weight dequantised) and stays within a
  norm-relative bound of transformers' float32 logits.
* Expert parallelism (8 forced CPU devices, a fresh process): a quantised block split over EP 2 / 4 and TP x EP
  (one format each) gives the one-device output, and the engine places the experts' codes and scales split over E and generates the
  one-device engine's greedy tokens.
* A converted checkpoint (`convert --quantize`) stores the quantised experts and restores them as they were.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import moe
from model import quant_methods as qm
from model import quantize_model as qmod
from model.config import ModelConfig
from model.quant import QuantizedArray
from tests.hf_tiny import served_copy
from tests.script_run import run_script

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny")
# rows per expert: empty experts first, in the middle and last; 13 = not a multiple of anything; M = 30 leaves 4
# rows past the groups (they must come out 0)
GROUP_SIZES = (0, 3, 0, 13, 1, 9, 0)
ROWS = 30


def _stacked(w_ekn, make) -> QuantizedArray:
    """Each expert of w [E, K, N] quantised by `make` (a quant_methods call), stacked."""
    return jax.vmap(make)(w_ekn)


FORMATS = {
    "int8": lambda w: qmod.quantize_expert_weight("int8", w),
    "fp8": lambda w: qmod.quantize_expert_weight("fp8", w),
    "int4_rtn": lambda w: qmod.quantize_expert_weight("int4_rtn", w),
    "fp8_per_tensor": lambda w: _stacked(w, lambda e: qm.rtn(e, "fp8", per_tensor=True)),
    "int4_symmetric_g32": lambda w: _stacked(w, lambda e: qm.rtn(e, "int4", group_size=32)),
    "int8_grouped": lambda w: _stacked(w, lambda e: dataclasses.replace(_q8_0(e), group_size=32)),
}


def _q8_0(w_kn) -> QuantizedArray:
    """GGUF Q8_0-like int8 with one scale per 32 input rows (the grouped int8 layout of model/quant.py)."""
    k, n = w_kn.shape
    scales = jnp.maximum(jnp.max(jnp.abs(w_kn.reshape(k // 32, 32, n)), axis=1) / 127.0, 1e-8)
    codes = jnp.round(w_kn / jnp.repeat(scales, 32, axis=0)).astype(jnp.int8)
    return QuantizedArray(codes, scales, fmt="int8")


def test_row_experts_follow_the_groups():
    got = moe.row_experts(jnp.asarray(GROUP_SIZES), ROWS)
    want = np.repeat(np.arange(len(GROUP_SIZES)), GROUP_SIZES)
    np.testing.assert_array_equal(np.asarray(got), np.concatenate([want, [len(GROUP_SIZES)] * (ROWS - len(want))]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_expert_matmul_equals_dequantized_experts(fmt):
    """float32: the quantised path is the dequantised experts' ragged_dot (rows past the groups are 0)."""
    e, k, n = len(GROUP_SIZES), 64, 40
    w = jax.random.normal(jax.random.key(0), (e, k, n), jnp.float32)
    q = FORMATS[fmt](w)
    assert isinstance(q, QuantizedArray) and q.shape == (e, k, n) and q.values.shape[0] == e
    x = jax.random.normal(jax.random.key(1), (ROWS, k), jnp.float32)
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    got = moe.expert_matmul(x, q, sizes)
    want = jax.lax.ragged_dot(x, q.dequantize(jnp.float32), sizes, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    assert not np.any(np.asarray(got)[sum(GROUP_SIZES) :])
    err = float(jnp.linalg.norm(q.dequantize() - w) / jnp.linalg.norm(w))
    assert 0 < err < 0.2, err  # a real quantisation of w, not a copy and not garbage


def test_expert_matmul_in_bfloat16():
    """bf16 activations: per-channel codes enter the dot exactly; the result is the dequantised bf16 experts'."""
    e, k, n = len(GROUP_SIZES), 64, 40
    w = jax.random.normal(jax.random.key(2), (e, k, n), jnp.float32)
    x = jax.random.normal(jax.random.key(3), (ROWS, k), jnp.bfloat16)
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    for method in ("int8", "fp8", "int4_rtn"):
        q = qmod.quantize_expert_weight(method, w.astype(jnp.bfloat16))
        got = moe.expert_matmul(x, q, sizes)
        assert got.dtype == jnp.bfloat16
        want = jax.lax.ragged_dot(x.astype(jnp.float32), q.dequantize(jnp.float32), sizes, precision="highest")
        rel = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        assert rel < 1e-2, (method, rel)


def test_quantized_experts_are_weight_only():
    w = jax.random.normal(jax.random.key(0), (2, 32, 16), jnp.float32)
    q = dataclasses.replace(qmod.quantize_expert_weight("fp8", w), act_fmt="fp8")
    with pytest.raises(ValueError, match="weight-only"):
        moe.expert_matmul(jnp.ones((4, 32)), q, jnp.asarray([2, 2]))


def test_quantize_expert_weight_by_chunks(monkeypatch):
    """A few experts at a time (the float32 copy is a slice): the same codes and scales as all at once."""
    w = jax.random.normal(jax.random.key(4), (5, 64, 32), jnp.bfloat16)
    whole = qmod.quantize_expert_weight("int4_rtn", w)
    monkeypatch.setattr(qmod, "EXPERT_CHUNK_ELEMENTS", 2 * 64 * 32)
    chunked = qmod.quantize_expert_weight("int4_rtn", w)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_expert_formats_and_groups():
    assert set(qmod.EXPERT_FORMATS) == set(qmod.QUANTIZATIONS)
    assert qmod.expert_form("int8") == "int8 round to nearest, weight-only"
    assert "not int4_awq's own scheme" in qmod.expert_form("int4_awq")
    assert [qmod.expert_int4_group(k) for k in (256, 96, 48, 16)] == [128, 32, 48, 16]
    with pytest.raises(ValueError, match="even"):
        qmod.expert_int4_group(15)


BLOCKS = {
    "shared_expert": ModelConfig.tiny_moe(),
    "gpt_oss": ModelConfig.tiny_moe(
        shared_expert_intermediate_size=0,
        moe_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        moe_routing="topk_softmax",
    ),
}


@pytest.fixture(scope="module")
def block_forward():
    return nnx.jit(lambda block, x: block(x))


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("method", ["int8", "fp8", "int4_rtn"])
def test_moe_block_with_quantized_experts(block_forward, kind, method):
    """The block over quantised experts equals the block over their dequantised float32 values."""
    cfg = BLOCKS[kind]
    quantised = moe.MoEMLP(cfg, jnp.float32, nnx.Rngs(params=0))
    if cfg.moe_bias:
        for name, scale in (("b_router", 1.0), ("b_gate_up", 0.5), ("b_down", 0.5)):
            slot = getattr(quantised, name)
            slot.set_value(scale * jax.random.normal(jax.random.key(len(name)), slot.get_value().shape))
    slots = {"w_gate_up": quantised.w_gate_up, "w_down": quantised.w_down}
    assert qmod.quantize_experts(slots, method) == ["w_gate_up", "w_down"]
    assert qmod.quantize_experts(slots, method) == []  # already quantised: kept
    dense = nnx.merge(*nnx.split(quantised))
    for slot in (dense.w_gate_up, dense.w_down):
        slot.set_value(slot.get_value().dequantize(jnp.float32))
    x = jax.random.normal(jax.random.key(9), (11, cfg.hidden_size), jnp.float32)
    (got, got_counts), (want, want_counts) = block_forward(quantised, x), block_forward(dense, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got_counts), np.asarray(want_counts))


# --- through the engine -------------------------------------------------------------------------------------------

ENGINE = dict(dtype="float32", attention_backend="xla", max_num_seqs=1, num_kv_blocks=8, block_size=16)
# Norm-relative bound of the served logits against transformers' float32 ones (every projection is quantised, the
# experts too): measured 0.013-0.029 (int8), 0.10-0.16 (fp8 e4m3: 3 mantissa bits), 0.31-0.36 (int4 in groups of
# 16-64 rows) on these unit-scale random weights; a misplaced scale or transposed expert is off by ~100%.
BOUNDS = {"int8": 0.06, "fp8": 0.3, "w8a8_fp8_rtn": 0.3, "int4_rtn": 0.5}
CODE_BYTES = {"int8": 1.0, "fp8": 1.0, "w8a8_fp8_rtn": 1.0, "int4_rtn": 0.5}  # per weight
# DeepSeek refuses the calibrated methods (fp8's scale search among them): its fp8 case is w8a8_fp8_rtn, whose
# experts take the same weight-only e4m3 form.
CASES = [
    (name, method)
    for name, methods in (
        ("qwen3_moe", ("int8", "fp8", "int4_rtn")),
        ("gpt_oss", ("int8", "fp8", "int4_rtn")),
        ("deepseek_v2", ("int8", "w8a8_fp8_rtn", "int4_rtn")),
    )
    for method in methods
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each tiny MoE checkpoint with a word-level tokenizer of its ids beside it (`LLM(path)` wants one)."""
    return {name: served_copy(name, tmp_path_factory.mktemp(name)) for name in sorted({n for n, _ in CASES})}


def _params(model) -> dict:
    """Slot path -> nnx.Param of every parameter of `model`."""
    return {".".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def _expert_slots(model) -> dict:
    """The routed experts' slots ([E, K, N]: w_gate_up and the down projection) of `model`."""
    return {n: v for n, v in _params(model).items() if len(v.get_value().shape) == 3}


def _dequantized_copy(model):
    """A copy of `model` with every weight-only QuantizedArray replaced by its float32 value (the quantised model's
    maths; W8A8 projections are kept: their activation quantisation is part of it)."""
    copy = nnx.merge(*nnx.split(model))
    for slot in _params(copy).values():
        if isinstance(slot.get_value(), QuantizedArray) and not slot.get_value().act_fmt:
            slot.set_value(slot.get_value().dequantize(jnp.float32))
    return copy


@pytest.mark.parametrize("name,method", CASES)
def test_engine_serves_quantized_experts(checkpoints, caplog, name, method):
    from serving.engine.llm import LLM, _score

    with caplog.at_level(logging.INFO, logger="model.quantize_model"):
        llm = LLM(checkpoints[name], quantization=method, max_model_len=64, **ENGINE)
    experts = _expert_slots(llm.model)
    assert experts and len(experts) % 2 == 0
    fmt = qmod.EXPERT_FORMATS[method]
    assert f"{len(experts)} routed expert weights ({qmod.expert_form(method)})" in caplog.text
    for slot_name, slot in experts.items():
        w = slot.get_value()
        assert isinstance(w, QuantizedArray) and w.fmt == fmt and not w.act_fmt, (slot_name, w)
        e, k, n = w.shape
        assert w.values.nbytes == e * k * n * CODE_BYTES[method]
        # against float32 experts: the codes' 1/4 or 1/8, plus float32 scales (and int4 zero points) per channel
        # (per group), which DeepSeek's 16-row down projections feel most: 0.31 of float32 in int8
        assert w.nbytes < 0.35 * e * k * n * 4, (slot_name, w.nbytes)

    prompt = json.load(open(os.path.join(DATA, name, "oracle.json")))["prompts"][0]
    got = llm.score(prompt)
    own = np.asarray(_score(_dequantized_copy(llm.model), jnp.asarray([prompt], jnp.int32))[0])
    np.testing.assert_allclose(got, own, rtol=1e-4, atol=1e-4 * float(np.abs(own).max()))
    want = np.load(os.path.join(DATA, name, "logits.npy"))
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert 1e-3 < rel < BOUNDS[method], f"{name} {method}: logits {rel:.4f} off HF's float32 (norm-relative)"


# --- expert parallelism -------------------------------------------------------------------------------------------

EP_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from checkpoints.tokenizer import NullTokenizer
from model import moe
from model.config import ModelConfig
from model.quant import QuantizedArray
from model.quantize_model import quantize_experts
from model.transformer import _storage_slots, random_model
from serving.config import EngineConfig
from serving.engine.engine import LLMEngine
from sharding.mesh import ParallelConfig, make_mesh

cfg = ModelConfig.tiny_moe(num_experts=8)
reference = nnx.jit(lambda block, x: block(x))
for method, par in (("int8", ParallelConfig(ep=4)), ("fp8", ParallelConfig(tp=2, ep=2)), ("int4_rtn", ParallelConfig(ep=2))):
    block = moe.MoEMLP(cfg, jnp.float32, nnx.Rngs(params=3))
    quantize_experts({"w_gate_up": block.w_gate_up, "w_down": block.w_down}, method)
    mesh = make_mesh(par, devices=jax.devices()[:par.num_devices])
    assert block._expert_axes(mesh), par
    x = jax.random.normal(jax.random.key(0), (13, cfg.hidden_size), jnp.float32)  # 13: pad rows on every mesh
    want, want_n = reference(block, x)
    got, got_n = nnx.jit(lambda block, x: block(x, mesh=mesh))(block, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(par))
    np.testing.assert_array_equal(np.asarray(got_n), np.asarray(want_n))

options = dict(attention_backend="xla", max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_kv_blocks=32,
               max_model_len=64, warmup=False, compilation_cache_dir="", quantization="int4_rtn")
prompts = [[5, 17, 300, 41, 9, 77, 2], [100, 3, 250]]
tokens = {}
for degrees in ({}, {"expert_parallel_size": 4}):
    engine = LLMEngine(random_model(cfg, jnp.float32, seed=7), NullTokenizer(), EngineConfig.from_kwargs(**options, **degrees))
    out = engine.generate([None] * 2, prompts, max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens[len(degrees)] = [list(o.token_ids) for o in out]
    w = _storage_slots(nnx.merge(engine.runner.graphdef, engine.runner.params))["layers.0.w_gate_up"].get_value()
    assert isinstance(w, QuantizedArray) and w.fmt == "int4", w
    for leaf in (w.values, w.scales, w.zeros):
        assert leaf.sharding.shard_shape(leaf.shape)[0] == cfg.num_experts // (4 if degrees else 1), leaf.sharding
assert tokens[0] == tokens[1], tokens
print("ok")
"""


def test_expert_parallel_quantized_experts():
    run_script(EP_SCRIPT, devices=8, timeout=900)


def test_converted_checkpoint_keeps_quantized_experts(tmp_path):
    """`pallas-serve convert --quantize` stores the stacked expert QuantizedArrays, which restore (lazy and eager)
    into a model with the quantised model's logits."""
    from checkpoints import convert, orbax_io
    from model.kv import NoCache
    from model.transformer import build_model, model_params, random_model

    cfg = ModelConfig.tiny_moe()
    params = {k: np.asarray(v) for k, v in model_params(random_model(cfg, jnp.float32, seed=2)).items()}
    orbax_io.save(str(tmp_path / "float"), cfg, params)
    convert.convert(str(tmp_path / "float"), str(tmp_path / "q"), quantize="int4_rtn")
    want = build_model(cfg, params, jnp.float32)
    qmod.quantize_model(want, "int4_rtn")
    tokens = jnp.asarray([[5, 9, 100, 3]])

    def logits(model):
        return np.asarray(model(tokens, jnp.arange(4)[None], None, NoCache(jnp.array([4])))[0])

    for lazy in (True, False):
        got_cfg, got, _ = orbax_io.restore(str(tmp_path / "q"), lazy=lazy)
        w = got["layers.0.w_gate_up"]
        assert isinstance(w, QuantizedArray) and w.fmt == "int4" and w.shape == (6, 64, 96)
        np.testing.assert_array_equal(logits(build_model(got_cfg, got, jnp.float32)), logits(want))


def test_update_weights_requantizes_experts():
    """`LLM.update_weights` with float weights re-quantises the quantised experts in their own format and place."""
    from checkpoints.tokenizer import NullTokenizer
    from model.transformer import model_params, random_model
    from serving.engine.llm import LLM

    cfg = ModelConfig.tiny_moe()
    options = dict(attention_backend="xla", max_num_seqs=1, num_kv_blocks=8, block_size=16, max_model_len=32)
    llm = LLM.from_model(random_model(cfg, jnp.float32, seed=1), NullTokenizer(), quantization="int4_rtn", **options)
    new = {k: np.asarray(v) for k, v in model_params(random_model(cfg, jnp.float32, seed=2)).items()}
    llm.update_weights(new)
    got = llm.params["layers.1.w_experts_down"]
    want = qmod.quantize_expert_weight("int4_rtn", new["layers.1.w_experts_down"])
    assert isinstance(got, QuantizedArray) and got.group_size == want.group_size == 48
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
