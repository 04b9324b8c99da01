"""The engine embedded in research code: construction from params / modules, batched logprobs through
the paged engine, reproducible rollouts, in-place weight updates (no recompilation, no second copy, prefix cache
cleared, quantised slots re-quantised, tensor parallel), and the RL example run small on SmolLM2.

The tiny model runs in float32 with the XLA reference kernels, so paged results must equal full-sequence scoring
to float rounding, and an updated engine must equal a fresh one built on the new weights exactly.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ModelConfig
from model.quant import QuantizedArray
from model.quant_methods import rtn
from model.transformer import model_params, random_model
from serving.core.request import SamplingParams
from serving.engine.llm import LLM
from tests.script_run import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTS = dict(
    max_num_seqs=4,
    max_num_batched_tokens=32,
    num_kv_blocks=48,
    block_size=4,
    max_model_len=64,
    attention_backend="xla",
    decode_steps=1,
    warmup=False,
    compilation_cache_dir="",
)
CFG = ModelConfig.tiny()


def _perturbed(params, scale=0.05, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(params))
    return {n: v + scale * jax.random.normal(k, v.shape, v.dtype) for k, (n, v) in zip(keys, params.items())}


def _reference_logprobs(model, prompt, cont):
    """log p(cont_j | prompt, cont_<j) by full-sequence scoring without a cache, padded to max_model_len tokens
    (causal: the padding changes no row read) so that one jitted forward serves every pair; run unjitted, each
    new length traced and compiled every op of the model again (seconds a length on a CPU)."""
    from serving.engine.llm import _score

    seq = list(prompt) + list(cont)
    logits = _score(model, jnp.asarray([seq + [0] * (OPTS["max_model_len"] - len(seq))], jnp.int32))
    lp = np.asarray(jax.nn.log_softmax(logits[0, : len(seq)], -1))
    return np.array([lp[len(prompt) - 1 + j, tok] for j, tok in enumerate(cont)])


@pytest.fixture(scope="module")
def params():
    return model_params(random_model(CFG, jnp.float32, seed=4))


@pytest.fixture(scope="module")
def llm(params):
    return LLM.from_params(CFG, params, **OPTS)


def _pairs(rng):
    shared = rng.integers(3, 500, 11).tolist()
    prompts = [shared, shared, shared, rng.integers(3, 500, 2).tolist(), rng.integers(3, 500, 40).tolist()]
    conts = [rng.integers(3, 500, n).tolist() for n in (5, 1, 9, 3, 20)]  # the last pair spans several steps
    return prompts, conts


def test_logprobs_equal_full_sequence_scoring_and_share_prompts(llm):
    prompts, conts = _pairs(np.random.default_rng(0))
    outs = llm.logprobs(prompts, conts)
    for p, c, o in zip(prompts, conts, outs):
        np.testing.assert_allclose(o.token_logprobs, _reference_logprobs(llm.model, p, c), atol=2e-5, rtol=2e-5)
        assert o.logprob == pytest.approx(float(np.sum(o.token_logprobs)), abs=1e-4)
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == outs[2].num_cached_tokens == 8
    again = llm.logprobs(prompts[:1], conts[:1])[0]  # the pair's blocks were cached by the first call
    assert again.num_cached_tokens == 8
    np.testing.assert_array_equal(again.token_logprobs, outs[0].token_logprobs)
    np.testing.assert_allclose(llm.score(prompts, conts), [o.logprob for o in outs], rtol=1e-6)
    llm.engine.scheduler.check_invariants()


def test_logprobs_refuse_bad_pairs(llm):
    with pytest.raises(ValueError, match="same length"):
        llm.logprobs([[5, 6]], [[7], [8]])
    with pytest.raises(ValueError, match="empty"):
        llm.logprobs([[5, 6]], [[]])
    with pytest.raises(ValueError, match="context length"):
        llm.logprobs([[5] * 60], [[6] * 10])


def test_generate_returns_logprobs_and_seeds_that_replay(llm):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    kw = dict(max_tokens=6, temperature=1.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, **kw)
    assert [o.seed for o in outs] == [outs[0].seed + i for i in range(3)]
    again = llm.generate(prompts, seed=outs[0].seed, **kw)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    alone = llm.generate([prompts[1]], seed=outs[1].seed, **kw)[0]  # one rollout replayed outside its batch
    assert alone.token_ids == outs[1].token_ids
    other = llm.generate(prompts, seed=outs[0].seed + 100, **kw)
    assert [o.token_ids for o in other] != [o.token_ids for o in outs]
    scored = llm.logprobs(prompts, [o.token_ids for o in outs])  # sampler logprobs are the model's own
    for o, s in zip(outs, scored):
        np.testing.assert_allclose(o.logprobs, s.token_logprobs, atol=2e-5, rtol=2e-5)


def test_update_weights_in_place_without_recompiling(params):
    llm = LLM.from_params(CFG, params, **OPTS)
    prompts, conts = _pairs(np.random.default_rng(1))
    before = llm.logprobs(prompts, conts)
    llm.generate(prompts[:3], max_tokens=4, ignore_eos=True)  # the same work before and after: same buckets
    runner = llm.engine.runner
    compiles = runner.num_compiles
    old = jax.tree.leaves(runner.params)
    assert llm.engine.scheduler.cache.num_cached_blocks > 0
    new = _perturbed(params)
    llm.update_weights(new)
    assert all(a.is_deleted() for a in old)  # donated: the new weights live in the old buffers
    assert all(not a.is_deleted() for a in jax.tree.leaves(new))  # the caller's arrays are its own
    assert llm.engine.scheduler.cache.num_cached_blocks == 0
    after = llm.logprobs(prompts, conts)
    gen_after = llm.generate(prompts[:3], max_tokens=4, ignore_eos=True)
    assert runner.num_compiles == compiles
    assert max(np.abs(a.token_logprobs - b.token_logprobs).max() for a, b in zip(before, after)) > 1e-3
    fresh = LLM.from_params(CFG, new, **OPTS)
    for a, b in zip(after, fresh.logprobs(prompts, conts)):
        np.testing.assert_array_equal(a.token_logprobs, b.token_logprobs)
    assert [o.token_ids for o in gen_after] == [o.token_ids for o in fresh.generate(prompts[:3], max_tokens=4)]
    np.testing.assert_array_equal(llm.score(prompts[0]), fresh.score(prompts[0]))  # the module was updated too


QKV = ("wq", "wk", "wv")


def test_update_weights_accepts_a_state_and_a_module_and_casts(params):
    llm = LLM.from_params(CFG, params, **OPTS)
    new_model = random_model(CFG, jnp.float32, seed=9)
    llm.update_weights(nnx.state(new_model))
    ref = _reference_logprobs(new_model, [5, 6, 7], [8, 9])
    np.testing.assert_allclose(llm.logprobs([[5, 6, 7]], [[8, 9]])[0].token_logprobs, ref, atol=2e-5, rtol=2e-5)
    llm.update_weights(random_model(CFG, jnp.float32, seed=9))
    bf16 = LLM.from_params(CFG, {n: v.astype(jnp.bfloat16) for n, v in params.items()}, **OPTS)
    assert bf16.dtype == jnp.bfloat16
    bf16.update_weights(params)  # float32 values cast to the engine's bfloat16
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(bf16.params))


def test_update_weights_refuses_bad_params(llm, params):
    with pytest.raises(ValueError, match="missing"):
        llm.update_weights({k: v for k, v in params.items() if k != "embed"})
    bad = dict(params, embed=jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="embed: shape"):
        llm.update_weights(bad)
    with pytest.raises(ValueError, match="QuantizedArray for a float"):  # q|k|v are one (fused) float slot
        llm.update_weights(dict(params, **{f"layers.0.{n}": rtn(params[f"layers.0.{n}"], "int8") for n in QKV}))


def test_update_weights_is_refused_while_requests_run_unless_drained(params):
    llm = LLM.from_params(CFG, params, **OPTS)
    rid = llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    llm.engine.step()
    with pytest.raises(RuntimeError, match="drain=True"):
        llm.update_weights(params)
    llm.update_weights(_perturbed(params), drain=True)
    assert not llm.engine.has_unfinished()
    assert llm.engine.pop_finished(rid).request.num_output_tokens == 3
    assert llm.weights_version == 1


def test_quantized_slots_are_requantized_in_place(params):
    """A model holding int8 and int4 (asymmetric, grouped) QuantizedArrays: float updates are re-quantised in
    the held layout, so the steps do not recompile, and the engine equals one built on the same quantisation."""
    q = dict(params)  # whole fused groups (q|k|v, gate|up: model/fused.py) quantised alike
    for n in QKV:
        q[f"layers.0.{n}"] = rtn(params[f"layers.0.{n}"], "int8")
    for n in ("w_gate", "w_up"):
        q[f"layers.1.{n}"] = rtn(params[f"layers.1.{n}"], "int4", group_size=16, asymmetric=True)
    llm = LLM.from_params(CFG, q, **OPTS)
    prompts, conts = [[5, 6, 7, 8, 9]], [[10, 11, 12]]
    before = llm.logprobs(prompts, conts)[0].token_logprobs
    compiles = llm.engine.runner.num_compiles
    new = _perturbed(params)
    llm.update_weights(new)  # float weights for the quantised slots
    assert llm.engine.runner.num_compiles == compiles
    held = llm.params
    assert isinstance(held["layers.0.wq"], QuantizedArray) and held["layers.1.w_up"].fmt == "int4"
    after = llm.logprobs(prompts, conts)[0].token_logprobs
    want = dict(new)
    for n in QKV:
        want[f"layers.0.{n}"] = rtn(new[f"layers.0.{n}"], "int8")
    for n in ("w_gate", "w_up"):
        want[f"layers.1.{n}"] = rtn(new[f"layers.1.{n}"], "int4", group_size=16, asymmetric=True)
    fresh = LLM.from_params(CFG, want, **OPTS).logprobs(prompts, conts)[0].token_logprobs
    np.testing.assert_allclose(after, fresh, atol=1e-6)
    assert np.abs(after - before).max() > 1e-3


class CharTokenizer:
    """A foreign tokenizer: encode/decode only (ids = byte + 3), EOS as an attribute."""

    eos_token_id = 2

    def encode(self, text):
        return [b + 3 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")


def test_from_model_with_a_foreign_tokenizer_copies_the_module():
    model = random_model(CFG.replace(eos_token_ids=()), jnp.float32, seed=5)
    llm = LLM.from_model(model, tokenizer=CharTokenizer(), **OPTS)
    assert llm.config.eos_token_ids == (2,)
    out = llm.generate("hi", max_tokens=5, ignore_eos=True)[0]
    assert out.text == CharTokenizer().decode(out.token_ids)
    llm.update_weights(_perturbed(model_params(model)))
    assert not any(a.is_deleted() for a in jax.tree.leaves(nnx.state(model)))  # the caller's module is intact
    with pytest.raises(ValueError, match="encode and decode"):
        LLM.from_model(model, tokenizer=object(), **OPTS)
    with pytest.raises(ValueError, match="dtype"):
        LLM.from_model(model, dtype="bfloat16", **OPTS)


TP_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from model.config import ModelConfig
from model.transformer import model_params, random_model
from serving.engine.llm import LLM
from sharding.mesh import ParallelConfig, make_mesh
from sharding.rules import shard_params

cfg = ModelConfig.tiny()
opts = dict(tensor_parallel_size=2, num_kv_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
            max_model_len=32, attention_backend="xla", decode_steps=1, warmup=False, compilation_cache_dir="")
prompts, conts = [[5, 17, 230, 41, 9, 77, 301], [5, 17, 230, 41, 9, 60]], [[12, 400, 3], [7]]
llm = LLM.from_params(cfg, model_params(random_model(cfg, jnp.float32, seed=3)), **opts)
before = llm.logprobs(prompts, conts)
runner = llm.engine.runner
specs = [a.sharding for a in jax.tree.leaves(runner.params)]
compiles = runner.num_compiles
new = model_params(random_model(cfg, jnp.float32, seed=8))  # single-device arrays: put on the tp shardings
llm.update_weights(new)
leaves = jax.tree.leaves(runner.params)
assert all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(leaves, specs))
wq = runner.params["layers"][0]["attn"]["wqkv"][...]  # fused q|k|v, split per shard
assert wq.sharding.shard_shape(wq.shape)[1] == wq.shape[1] // 2, wq.sharding
after = llm.logprobs(prompts, conts)
assert runner.num_compiles == compiles, (runner.num_compiles, compiles)
assert max(np.abs(a.token_logprobs - b.token_logprobs).max() for a, b in zip(before, after)) > 1e-2
# A fresh engine over the same weights, given already sharded on a tp mesh (a trainer's): the same scores.
mesh = make_mesh(ParallelConfig(tp=2), devices=jax.devices()[:2])
fresh = LLM.from_params(cfg, shard_params(new, mesh, head_dim=cfg.head_dim), **opts)
for a, b in zip(after, fresh.logprobs(prompts, conts)):
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-6)
print("ok")
"""


def test_update_weights_under_tensor_parallelism():
    """tensor_parallel_size=2 on forced CPU devices: the swap keeps every sharding (weights split by heads),
    compiles nothing, and equals a fresh engine built from parameters already sharded on a tp mesh."""
    run_script(TP_SCRIPT, devices=8, timeout=300)


def test_rl_example_on_smollm2(tmp_path):
    """examples/rl_loop.py run small: SFT, two generate / score / policy-gradient / update_weights rounds, and a
    final generation. The engine's logprobs match the trainer's at the weights that sampled; after the last update
    they differ from before and equal a fresh LLM.from_params on the trained weights; nothing compiled after the
    first round (engine steps and the train step)."""
    from checkpoints.loader import default_model_path

    try:
        default_model_path(download=False)
    except FileNotFoundError:
        pytest.skip("the default SmolLM2 checkpoint is not cached (python -m checkpoints.fetch_default)")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import rl_loop
    finally:
        sys.path.pop(0)
    opts = dict(
        attention_backend="xla",
        max_num_batched_tokens=32,
        decode_steps=1,
        warmup=False,
        compilation_cache_dir=str(tmp_path),  # kept out of the shared cache (on a CPU host it stays off)
    )
    res = rl_loop.run(
        sft_steps=2,
        iterations=2,
        max_tokens=6,
        seq_len=24,
        prompt_tokens=10,
        log=lambda s: print(s, flush=True),
        **opts,
    )
    llm, prompts, samples = res["llm"], res["prompts"], res["history"][-1]["samples"]
    assert res["compiles_at_end"] == res["compiles_after_first"]
    assert all(h["trainer_engine_gap"] < 1e-3 for h in res["history"])
    assert res["history"][0]["seeds"] != res["history"][1]["seeds"]
    after = llm.logprobs(prompts, samples)
    before = res["history"][-1]["scored"]  # the engine's logprobs of the last samples, before the last update
    assert max(np.abs(a.token_logprobs - b).max() for a, b in zip(after, before)) > 1e-4
    # The fresh engine repeats the updated one's calls in order, so their prefix caches (which decide how prompts
    # are split into steps, hence float rounding) are in the same state at each call.
    fresh = LLM.from_params(llm.config, res["model"], tokenizer=llm.tokenizer, **res["engine_options"])
    again = fresh.generate(prompts, max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in res["final"]]
    np.testing.assert_array_equal([o.logprobs for o in again], [o.logprobs for o in res["final"]])
    for a, b in zip(after, fresh.logprobs(prompts, samples)):
        np.testing.assert_array_equal(a.token_logprobs, b.token_logprobs)
