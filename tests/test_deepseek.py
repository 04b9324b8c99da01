"""DeepSeek-V2 / V3 (model/deepseek.py, checkpoints/deepseek_hf.py) against Hugging Face on tiny random checkpoints.

tests/data/hf_tiny/deepseek_v3 (tools/make_mla_fixture.py) holds transformers' DeepseekV3ForCausalLM with a q LoRA,
interleaved YaRN RoPE with mscale, a dense first layer, then an MoE layer with a shared expert, grouped routing
and a non-zero correction bias; deepseek_v2 a DeepseekV2ForCausalLM shaped like V2-Lite (no q LoRA, softmax
group-limited greedy routing, two shared experts, complex YaRN RoPE). Each comes with HF's float32 logits and
greedy continuations. The model is run here through
the scoring path and through the paged latent cache (chunked prefill, then decode steps; the MLA kernels in
Pallas interpret mode, or their XLA references where the interpreter would be too slow for CI).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.deepseek_hf import load_hf_deepseek
from model.deepseek import DeepseekConfig, route, route_v2
from model.kv import NoCache, PagedMeta
from model.mla import init_mla_paged_cache

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny")
FIXTURE = os.path.join(DATA, "deepseek_v3")


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def loaded(request):
    with open(os.path.join(DATA, request.param, "oracle.json")) as f:
        oracle = json.load(f)
    cfg, model = load_hf_deepseek(os.path.join(DATA, request.param))
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions, caches, meta):
        return nnx.merge(graphdef, state)(tokens, positions, caches, meta)

    return cfg, (forward, state), oracle | dict(name=request.param)


def paged_generate(cfg, fwd, prompt, steps, *, chunk, page_size, backend, max_len=96):
    """Greedy tokens of one sequence through the paged latent cache: prefill `chunk` tokens a step, then decode.
    The pool and table sizes depend on `max_len` only, so sequences of one page size share compiled steps."""
    forward, state = fwd
    assert len(prompt) + steps <= max_len
    num_pages = math.ceil(max_len / page_size) + 2
    caches = init_mla_paged_cache(cfg.num_layers, num_pages, page_size, cfg.mla, jnp.float32)
    caches = [(jnp.full_like(p, jnp.nan),) for (p,) in caches]  # a read of an unwritten slot poisons the logits
    table = np.random.default_rng(0).permutation(num_pages)[None, : math.ceil(max_len / page_size)].astype(np.int32)
    tokens, done, out = list(prompt), 0, []
    while len(out) < steps:
        new = tokens[done : done + chunk] if done < len(prompt) else tokens[-1:]
        pos = np.arange(done, done + len(new))
        slots = table[0, pos // page_size] * page_size + pos % page_size
        meta = PagedMeta(
            slot_mapping=jnp.asarray(slots, jnp.int32),
            block_tables=jnp.asarray(table),
            kv_lens=jnp.asarray([done + len(new)], jnp.int32),
            cu_q_lens=jnp.asarray([0, len(new)], jnp.int32),
            num_seqs=jnp.int32(1),
            decode_only=len(new) == 1,
            backend=backend,
        )
        logits, caches = forward(state, jnp.asarray([new]), jnp.asarray(pos)[None], caches, meta)
        done += len(new)
        if done >= len(prompt):
            out.append(int(jnp.argmax(logits[0, -1])))
            tokens.append(out[-1])
    return out


def test_prompt_logits_match_hf(loaded):
    cfg, (forward, state), oracle = loaded
    prompt = jnp.asarray([oracle["prompts"][0]])
    t = prompt.shape[1]
    logits, _ = forward(state, prompt, jnp.arange(t)[None], None, NoCache(valid_len=jnp.asarray([t])))
    hf = np.load(os.path.join(DATA, oracle["name"], "logits.npy"))
    np.testing.assert_allclose(np.asarray(logits[0]), hf, atol=1e-4, rtol=0)


def test_greedy_paged_xla_matches_hf(loaded):
    cfg, fwd, oracle = loaded
    # The long prompt (past YaRN's original context) in 16-token chunks over 8-token pages; the short one in one.
    for prompt, greedy in zip(oracle["prompts"][::2], oracle["greedy"][::2]):
        assert paged_generate(cfg, fwd, prompt, len(greedy), chunk=16, page_size=8, backend="xla") == greedy


def test_greedy_paged_interpret_kernels_match_hf(loaded):
    cfg, fwd, oracle = loaded
    if oracle["name"] != "deepseek_v3":
        pytest.skip("the interpreter is slow: one checkpoint runs the kernels (the V3 one, which has a q LoRA)")
    prompt, greedy = oracle["prompts"][2], oracle["greedy"][2][:3]
    assert paged_generate(cfg, fwd, prompt, len(greedy), chunk=3, page_size=4, backend="interpret") == greedy


@pytest.mark.gpu
@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a GPU")
def test_greedy_paged_triton_kernels_match_hf(loaded):
    cfg, fwd, oracle = loaded
    for prompt, greedy in zip(oracle["prompts"], oracle["greedy"]):
        assert paged_generate(cfg, fwd, prompt, len(greedy), chunk=16, page_size=16, backend="triton") == greedy


def test_config_from_hf_and_refusals():
    with open(os.path.join(FIXTURE, "config.json")) as f:
        hf = json.load(f)
    cfg = DeepseekConfig.from_hf(hf)
    assert cfg.mla.yarn is not None and cfg.mla.yarn.factor == 4.0 and cfg.mla.q_lora_rank == 24
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [False, True]
    for change, match in (
        (dict(scoring_func="softmax"), "routing"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "RoPE"),
        (dict(n_group=3), "n_group"),
        (dict(architectures=["DeepseekV2ForCausalLM"], topk_method="noaux_tc"), "routing"),
    ):
        with pytest.raises(ValueError, match=match):
            DeepseekConfig.from_hf({**hf, **change})


def test_loader_refuses_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(os.path.join(FIXTURE, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(ValueError, match="router_bias"):
        load_hf_deepseek(str(tmp_path))


def test_route_groups_bias_and_scaling():
    # 2 groups of 3 experts, keep 1 group, top-2. Group 1's two best choices (0.9 + 0.6 after the bias) beat
    # group 0's (0.8 + 0.5) although expert 0 has the best raw score; weights come from the raw scores.
    scores = np.array([[0.8, 0.5, 0.1, 0.7, 0.6, 0.2]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 0.2, 0.0, 0.0], np.float32)
    logits = jnp.asarray(np.log(scores / (1 - scores)))
    w, e = route(logits, jnp.asarray(bias), k=2, n_group=2, topk_group=1, normalize=True, scaling=2.5)
    assert e.tolist() == [[3, 4]]
    np.testing.assert_allclose(np.asarray(w), [[2.5 * 0.7 / 1.3, 2.5 * 0.6 / 1.3]], rtol=1e-5)


def test_route_v2_group_limited_greedy():
    # 2 groups of 2: group 0's best (0.4) beats group 1's (0.3), so experts 2 and 3 are out though 3 beats 1.
    probs = np.array([[0.4, 0.1, 0.2, 0.3]], np.float32)
    logits = jnp.asarray(np.log(probs))
    w, e = route_v2(logits, k=2, n_group=2, topk_group=1, grouped=True, scaling=1.5)
    assert e.tolist() == [[0, 1]]
    np.testing.assert_allclose(np.asarray(w), [[0.6, 0.15]], rtol=1e-5)
    w, e = route_v2(logits, k=2, n_group=2, topk_group=1, grouped=False, scaling=1.0)
    assert e.tolist() == [[0, 3]]
    np.testing.assert_allclose(np.asarray(w), [[0.4, 0.3]], rtol=1e-5)
