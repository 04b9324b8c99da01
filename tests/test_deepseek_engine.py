"""DeepSeek-V3 (MLA, MoE with shared experts, first dense layers) served through `LLM(path)` and the paged engine.

The tiny DeepseekV3ForCausalLM of tests/data/hf_tiny/deepseek_v3 (tools/make_mla_fixture.py) is copied with a
word-level tokenizer (the prompts are token ids) and loaded as a user would load it. Greedy continuations of HF's
three prompts come back token for token, with chunked prefill (8-token steps; the 70-token prompt runs past YaRN's
original context), preemption (a pool too small for all three) and prefix caching (the second prompt shares the
first's 16 tokens) on; also through the OpenAI server over the same LLM, and with tensor_parallel_size=2 on two
forced CPU devices (a subprocess); the DeepSeek-V2 fixture's too. int8 weights run through the on-device decode loop against the quantised
model's own unpaged greedy tokens. The KV pool: its latent layout, bytes per block against MHA, refusals.

The module's engine runs the Pallas MLA kernels in interpret mode (padded decode rows and ragged chunks included);
the int8 and tensor-parallel engines run their XLA references (the kernels per device are the same code).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.architectures import MLA_ARCHITECTURES, architecture_of, supported_models_table
from model.config import ModelConfig
from model.deepseek import DeepseekConfig, place_mla
from serving.engine.kv_pool import is_latent, kv_bytes_per_block
from serving.engine.llm import LLM
from tests.hf_tiny import served_copy
from tests.script_run import run_script

SOURCE = os.path.join(os.path.dirname(__file__), "data", "hf_tiny", "deepseek_v3")
ENGINE = dict(
    dtype="float32",
    max_num_seqs=2,
    max_num_batched_tokens=8,
    num_kv_blocks=26,  # 25 usable 4-token blocks: the three sequences need 21 + 9 + 5
    block_size=4,
    max_model_len=96,
    attention_backend="interpret",  # the Pallas MLA kernels through the interpreter
    decode_steps=1,
    warmup=False,
    compilation_cache_dir="",
    enable_prefix_caching=True,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    with open(os.path.join(SOURCE, "oracle.json")) as f:
        oracle = json.load(f)
    return served_copy("deepseek_v3", tmp_path_factory.mktemp("ckpt") / "deepseek_v3"), oracle


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], **ENGINE)


def test_llm_loads_the_directory_and_scores_as_hf(llm, checkpoint):
    _, oracle = checkpoint
    assert isinstance(llm.config, DeepseekConfig) and llm.config.mla.yarn is not None
    want = np.load(os.path.join(SOURCE, "logits.npy"))
    got = llm.score(oracle["prompts"][0])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_through_the_engine_matches_hf(llm, checkpoint):
    _, oracle = checkpoint
    sched = llm.engine.scheduler
    hits, preempted = sched.prefix_hit_tokens, sched.num_preemptions
    got = [o.token_ids for o in llm.generate(oracle["prompts"], max_tokens=12, temperature=0.0, ignore_eos=True)]
    assert got == oracle["greedy"]
    assert sched.num_preemptions > preempted, "the pool was meant to be too small for all three prompts"
    assert sched.prefix_hit_tokens > hits, "the second prompt (or a resumed one) was meant to hit the cache"
    # Text in, text out through the tokenizer: the same continuation.
    text = " ".join(f"t{i}" for i in oracle["prompts"][2])
    (out,) = llm.generate(text, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert out.token_ids == oracle["greedy"][2][:4] and out.text.split() == [f"t{i}" for i in out.token_ids]


def test_deepseek_v2_lite_shape_through_the_engine(tmp_path):
    """The V2 fixture (no q LoRA, softmax group-limited routing, two shared experts, complex YaRN RoPE) through
    LLM(path): HF's greedy tokens with preemption and prefix hits (a 13-block pool for two 35-token sequences)."""
    source = os.path.join(os.path.dirname(SOURCE), "deepseek_v2")
    with open(os.path.join(source, "oracle.json")) as f:
        oracle = json.load(f)
    llm = LLM(
        served_copy("deepseek_v2", tmp_path / "deepseek_v2"), **{**ENGINE, "num_kv_blocks": 13, "max_model_len": 48}
    )
    assert llm.config.mla.q_lora_rank is None and llm.config.routing == "group_limited_greedy"
    got = [o.token_ids for o in llm.generate(oracle["prompts"], max_tokens=12, temperature=0.0, ignore_eos=True)]
    assert got == oracle["greedy"]
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.prefix_hit_tokens > 0


def test_latent_pool_shape_and_router_load(llm):
    runner = llm.engine.runner
    cfg = llm.config
    assert len(runner.kv_cache) == cfg.num_layers
    for (pages,) in runner.kv_cache:  # one latent row of R + Dr = 32 + 16 per token: one "KV head"
        assert pages.shape == (1, runner.num_blocks, 4, 48) and pages.dtype == jnp.float32
    assert "26 blocks of 4" in llm.kv_pool_summary()
    load = runner.router_load()  # [L, E]: the dense first layer routes nothing, the MoE layer k per real token
    assert load.shape == (2, 8) and not load[0].any() and load[1].sum() > 0 and load[1].sum() % 3 == 0


def test_params_by_slot_path_and_update_weights_refused(llm, checkpoint):
    from checkpoints.deepseek_hf import lazy_deepseek

    _, slots = lazy_deepseek(checkpoint[0])
    params = llm.params
    assert set(params) == set(slots)
    np.testing.assert_array_equal(np.asarray(params["layers.1.attn.w_o"]), slots["layers.1.attn.w_o"])
    with pytest.raises(ValueError, match="not supported for DeepSeek"):
        llm.update_weights(params)


def test_kv_bytes_per_block_mla_against_mha():
    # DeepSeek-V3's shapes: 61 layers, 128 heads, kv_lora_rank 512, rope dim 64; a latent row is 576 values.
    with open(os.path.join(SOURCE, "config.json")) as f:
        hf = json.load(f)
    v3 = dict(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)
    v3 |= dict(qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536, hidden_size=7168, n_group=8, topk_group=4)
    v3 |= dict(n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3)
    cfg = DeepseekConfig.from_hf({**hf, **v3})
    assert is_latent(cfg) and (cfg.num_kv_heads, cfg.head_dim) == (1, 576)

    class Holder:  # kv_bytes_per_block reads only the model's config
        def __init__(self, cfg):
            self.cfg = cfg

    assert kv_bytes_per_block(Holder(cfg), 16, jnp.bfloat16) == 61 * 16 * 576 * 2
    assert kv_bytes_per_block(Holder(cfg), 16, jnp.float32) == 61 * 16 * 576 * 4
    # The same layers cached as 128 K and V heads of 128: 2 * 128 * 128 / 576 = 56.9x the latent pool.
    mha = ModelConfig(
        name="mha", vocab_size=128, hidden_size=7168, intermediate_size=64, num_layers=61, num_heads=128,
        num_kv_heads=128, head_dim=128,
    )  # fmt: skip
    assert not is_latent(mha)
    assert kv_bytes_per_block(Holder(mha), 16, jnp.bfloat16) == 2 * 61 * 128 * 16 * 128 * 2
    ratio = kv_bytes_per_block(Holder(mha), 16, jnp.bfloat16) / kv_bytes_per_block(Holder(cfg), 16, jnp.bfloat16)
    assert ratio == pytest.approx(2 * 128 * 128 / 576)


def test_latent_pool_sized_whole_per_device(monkeypatch):
    """A device holds every latent row whatever the tensor degree (every query head reads them all), where an MHA
    pool's block shrinks with the heads a device owns."""
    from types import SimpleNamespace

    from serving.engine import kv_pool

    with open(os.path.join(SOURCE, "config.json")) as f:
        model = SimpleNamespace(cfg=DeepseekConfig.from_hf(json.load(f)))
    mesh = SimpleNamespace(
        shape={"tensor": 2, "pipeline": 1}, axis_names=("tensor", "pipeline"), devices=np.zeros((2, 1))
    )
    monkeypatch.setattr(kv_pool, "_free_bytes", lambda mesh=None: (1 << 30, True))  # a device's memory
    per_block = kv_bytes_per_block(model, 16, jnp.bfloat16)
    assert per_block == 2 * 16 * 48 * 2  # 2 layers, 16 tokens, 32 + 16 values, bf16
    for m in (None, mesh):
        assert kv_pool.size_kv_pool(model, 16, jnp.bfloat16, 0.5, 100, m) == (1 << 29) // per_block


def test_refusals(checkpoint, tmp_path):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="dtype must be bf16/f16/f32"):  # no quantised latent pages yet
        _ = LLM(path, **{**ENGINE, "kv_cache_dtype": "int8"}).engine
    from checkpoints.deepseek_hf import lazy_deepseek

    cfg, _ = lazy_deepseek(path)
    for axes, match in (
        (("pipeline", "tensor"), "pipeline_parallel_size=2 is not supported"),
        (("tensor",), "3 heads"),
    ):
        mesh = jax.sharding.AbstractMesh((2,) * len(axes), axes)
        holder = type("M", (), {"cfg": dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, num_heads=3))})
        with pytest.raises(ValueError, match=match):
            place_mla(holder(), mesh)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match="MLA model"):  # the Llama-layout reader sends it to its own loader
        architecture_of(hf)


def test_registry_lists_mla_architectures():
    table = supported_models_table()
    for name in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert name in MLA_ARCHITECTURES
        row = next(line for line in table.splitlines() if f"`{name}`" in line)
        assert "MLA" in row and "MoE + shared experts" in row


def test_int8_weights_through_the_engine(checkpoint):
    """quantization="int8": MLA's w_a / w_q_b / w_o, the dense and shared SwiGLUs and the routed experts become
    int8 per-channel; w_kv_b (absorbed per head), routers and the LM head stay float. The paged engine's greedy
    tokens are the quantised model's own (its unpaged logits, one token at a time), here through the on-device
    decode loop with async scheduling (the serving defaults)."""
    from model.deepseek import projections
    from model.quant import QuantizedArray

    path, oracle = checkpoint
    options = dict(max_num_seqs=1, quantization="int8", decode_steps=4, attention_backend="xla")
    llm = LLM(path, **{**ENGINE, **options})
    quantised = projections(llm.model)
    assert len(quantised) == 2 * 3 + 2 + 2 and all(
        isinstance(p.get_value(), QuantizedArray) for p in quantised.values()
    )
    moe = llm.model.layers[1].mlp
    assert not isinstance(moe.w_router.get_value(), QuantizedArray)
    assert all(isinstance(w.get_value(), QuantizedArray) for w in (moe.w_gate_up, moe.w_down))
    want = np.load(os.path.join(SOURCE, "logits.npy"))
    got = llm.score(oracle["prompts"][0])
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-4 < err < 0.05, err  # quantised (not the float weights), and close to them
    prompt, own = list(oracle["prompts"][2]), []
    for _ in range(6):
        own.append(int(llm.score(prompt + own)[-1].argmax()))
    (out,) = llm.generate([prompt], max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out.token_ids == own
    runner = llm.engine.runner
    assert runner.has_executable(("loop", 4, 1, runner.width_buckets[0])), "the decode loop was meant to run"
    with pytest.raises(ValueError, match="needs calibration"):
        LLM(path, **{**ENGINE, "quantization": "int4_awq"})


def test_the_server_serves_it(llm, checkpoint):
    """The OpenAI server over the same LLM (its engine compiled above): a text completion is HF's greedy one."""
    import httpx

    from serving.api import app as srv
    from tests.live_app import serving_in_thread

    _, oracle = checkpoint
    asgi = srv.create_app(lambda: llm, model_name="deepseek-v3-tiny", max_queue=8, warmup=False)
    body = dict(model="deepseek-v3-tiny", prompt=" ".join(f"t{i}" for i in oracle["prompts"][2]), max_tokens=4)
    with serving_in_thread(asgi) as (_, _, url):
        response = httpx.post(url + "/v1/completions", json=body | dict(temperature=0.0), timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].split() == [f"t{i}" for i in oracle["greedy"][2][:4]]


TP_SCRIPT = r"""
import json, sys
import jax
from serving.engine.llm import LLM

path, options, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(path, **options)
outs = llm.generate(prompts, max_tokens=6, temperature=0.0, ignore_eos=True)
attn, (pool,) = llm.model.layers[1].attn, llm.engine.runner.kv_cache[1]
print("ok", json.dumps(dict(
    devices=jax.device_count(),
    tokens=[o.token_ids for o in outs],
    w_o=[str(a) for a in attn.w_o.get_value().sharding.spec],
    w_kv_b=[str(a) for a in attn.w_kv_b.get_value().sharding.spec],
    pool_replicated=pool.sharding.is_fully_replicated,
)))
"""


def test_tensor_parallel_heads_match_hf(checkpoint):
    """tensor_parallel_size=2 on two forced CPU devices: w_q_b / w_kv_b / w_o split by heads, the latent pool
    replicated, and the greedy continuations still HF's."""
    path, oracle = checkpoint
    options = json.dumps({**ENGINE, "tensor_parallel_size": 2, "attention_backend": "xla"})
    got = run_script(TP_SCRIPT, path, options, json.dumps(oracle["prompts"][1:]), devices=2, timeout=900)
    assert got["devices"] == 2 and got["pool_replicated"]
    assert got["w_o"][0] == "tensor" and got["w_kv_b"][1] == "tensor"
    assert got["tokens"] == [g[:6] for g in oracle["greedy"][1:]]
