"""Trained-head speculation (speculative_method="medusa") on a tiny random model, CPU, XLA attention.

The target has tied embeddings, so at random weights it mostly repeats its last token. Heads: random ones (init
scale 2: mostly rejected) written to an Orbax checkpoint in a tmp dir and loaded by the engine as a user's would
be, and zero ones (each head then repeats the target's own next-token guess: mostly accepted here). Greedy output must equal plain decoding token for token under prefix caching, chunked prefill (a
32-token budget under 40-60-token prompts) and forced preemption, with every KV block back afterwards; the hidden
state the proposer drafts from must be the target's own at the request's last token; both through the on-device
loop (serving/spec/device_loop.py, the default) and the host verify path. Sampled rows through the loop: the first
emitted token follows the target's processed distribution (chi-square), with drafts from the heads' q. The
training pipeline must write a checkpoint that loads, and lower its loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.kv import NoCache
from model.medusa import HeadsConfig, MedusaHeads, load_heads, save_heads
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.core.scheduler import Scheduler
from serving.engine.engine import LLMEngine
from serving.engine.runner import RowInput
from serving.engine.sampler import sampling_tensors
from serving.spec import device_loop
from serving.spec.head_proposer import MedusaProposer
from serving.spec.policy import SpecPolicy
from serving.spec.proposers import ProposalRow
from serving.spec.rule import processed_target_probs
from serving.spec.verify import SpecDecoder, policy_config
from tests.test_spec_device_loop import _chi2_pvalue

CFG = ModelConfig.tiny(tie_word_embeddings=True)
K = 3
OPTIONS = dict(
    attention_backend="xla",
    max_num_seqs=4,
    max_num_batched_tokens=32,
    block_size=16,
    num_kv_blocks=64,
    decode_steps=4,
    max_model_len=128,
    warmup=False,
    compilation_cache_dir="",
)
RNG = np.random.default_rng(0)
_A = RNG.integers(3, CFG.vocab_size, 50).tolist()
PROMPTS = [_A, _A[:34] + RNG.integers(3, CFG.vocab_size, 8).tolist(), RNG.integers(3, 500, 60).tolist(), _A[:5]]
MAX_TOKENS = [40, 30, 24, 36]


def _heads(init_scale: float) -> MedusaHeads:
    return MedusaHeads(HeadsConfig(K, CFG.hidden_size, CFG.vocab_size), rngs=nnx.Rngs(1), init_scale=init_scale)


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return save_heads(str(tmp_path_factory.mktemp("heads")), _heads(2.0), {"note": "random"})


@pytest.fixture(scope="module")
def engine(heads_dir):
    config = EngineConfig.from_kwargs(
        **OPTIONS, speculative_method="medusa", num_speculative_tokens=K, speculative_model=heads_dir
    )
    return LLMEngine(random_model(CFG, jnp.float32, seed=7), NullTokenizer(), config)


def _use_scheduler(engine, num_blocks: int) -> Scheduler:
    c = engine.config
    engine.scheduler = Scheduler(
        num_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens, engine.max_model_len, True
    )
    return engine.scheduler


@contextlib.contextmanager
def _speculating(engine, spec, device_loop: bool = True):
    """The engine with `spec` as its SpecDecoder; device_loop False: every verify pass on the host path."""
    saved, engine.spec = engine.spec, spec
    saved_loop, engine.spec_loops.enabled = engine.spec_loops.enabled, device_loop
    try:
        yield spec
    finally:
        engine.spec, engine.spec_loops.enabled = saved, saved_loop


def _run(engine, params: SamplingParams, num_blocks: int = 64):
    sched = _use_scheduler(engine, num_blocks)
    rids = [engine.add_request(p, dataclasses.replace(params, max_tokens=m)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    while engine.has_unfinished():
        engine.step()
        sched.check_invariants()
    assert engine.step() == []  # an idle step releases the state kept for finished requests
    assert sched.block_manager.num_used == sched.cache.num_cached_blocks  # rejected drafts' blocks all came back
    return [engine.pop_finished(r).request.output_token_ids for r in rids], sched


@pytest.fixture(scope="module")
def reference(engine):
    with _speculating(engine, None):
        return _run(engine, SamplingParams(temperature=0.0, ignore_eos=True))[0]


def _decoder(engine, heads) -> SpecDecoder:
    proposer = MedusaProposer(heads, engine.runner, K)
    return SpecDecoder(
        engine.scheduler, engine.runner, engine.sampler, engine.outputs, proposer, K, SpecPolicy(policy_config(K, 0))
    )


@pytest.mark.parametrize("heads, device_loop", [("random", True), ("zero", True), ("random", False), ("zero", False)])
def test_greedy_identical_with_prefix_cache_chunked_prefill_and_preemption(engine, reference, heads, device_loop):
    """Through the on-device loop (serving/spec/device_loop.py: heads drafting inside the loop) and the host path."""
    spec = engine.spec if heads == "random" else _decoder(engine, _heads(0.0))
    assert spec.proposer.name == "medusa"
    loops = engine.spec_loops.num_loops
    with _speculating(engine, spec, device_loop):
        before = spec.counters.as_dict()
        got, sched = _run(engine, SamplingParams(temperature=0.0, ignore_eos=True), num_blocks=10)
    assert got == reference
    assert (engine.spec_loops.num_loops > loops) == device_loop
    assert sched.num_preemptions > 0 and sched.stats().prefix_hit_tokens > 0
    after = spec.counters.as_dict()
    m = {k: after[k] - before[k] for k in ("passes", "drafted", "accepted", "emitted")}
    assert m["passes"] > 0 and m["emitted"] == m["accepted"] + m["passes"]
    assert not spec.proposer.tracked and not spec.policy.tracked
    if heads == "random":  # many rejections (rolled back: the block check in _run)
        assert m["drafted"] - m["accepted"] > 20
    else:  # the heads repeat the target's guess, and this target repeats itself
        assert m["accepted"] > 0.5 * m["drafted"]
    assert "medusa" in spec.metrics()


@pytest.mark.parametrize("device_loop", [True, False])
def test_drafts_come_from_the_targets_hidden_state_at_the_last_token(engine, device_loop):
    """After every step, the state the proposer holds for each of two running requests (verify rows with accepted
    drafts among them) is the target's final-normed hidden state at the request's last token, recomputed here with
    the contiguous reference path. The model is causal and a request's tokens only grow, so one reference pass
    per request over the longest token list it reached gives the state at every earlier step's last token (one
    pass per step compiled the unjitted model afresh for each length). With the device loop, the state is the one
    the loop carried out of its last iteration (a step runs up to decode_steps iterations: fewer steps)."""
    spec = _decoder(engine, _heads(0.0))
    model = nnx.merge(engine.runner.graphdef, engine.runner.params)
    held, tokens = [], {}  # (rid, the proposer's state, the request's length then); rid -> its latest tokens
    with _speculating(engine, spec, device_loop):
        sched = _use_scheduler(engine, 64)
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request(PROMPTS[i], params) for i in (2, 0)]
        for _ in range(10):
            engine.step()
            for rid in rids:
                req, got = sched.requests.get(rid), spec.proposer._hidden.get(rid)
                if req is None or got is None or got[2] != req.num_tokens:
                    continue
                held.append((rid, np.asarray(got[0][got[1]]), req.num_tokens))
                tokens[rid] = list(req.all_token_ids)
        for rid in rids:
            engine.abort(rid)
        engine.step()
    want = {}
    for rid, ids in tokens.items():
        t = len(ids)
        want[rid] = np.asarray(
            model(jnp.asarray([ids]), jnp.arange(t)[None], None, NoCache(jnp.array([t])), return_hidden=True)[2][0]
        )
    for rid, got, n in held:  # the last token (position n - 1) came from the state at position n - 2
        np.testing.assert_allclose(got, want[rid][n - 2], rtol=1e-4, atol=1e-4)
    assert len(held) >= (8 if device_loop else 12) and spec.counters.accepted > 0


def test_sampled_drafts_are_drawn_from_q_and_seeded_runs_repeat(engine):
    proposer = engine.spec.proposer
    hidden = jax.random.normal(jax.random.key(0), (2, CFG.hidden_size))
    proposer.record(["g", "s"], [3, 3], hidden)
    st = sampling_tensors([_FakeRequest(0.0), _FakeRequest(1.0)])
    p = proposer.propose([ProposalRow("g", [5, 6, 7], K), ProposalRow("s", [5, 6, 7], 2)], st)
    q = np.asarray(p.draft_probs)
    assert p.num_draft.tolist() == [K, 2] and q.shape == (2, K, CFG.vocab_size)
    np.testing.assert_allclose(q[0].sum(-1), 1.0, atol=1e-5)
    assert (q[0].max(-1) == 1.0).all() and (q[0].argmax(-1) == p.draft_tokens[0]).all()  # greedy: one-hot
    assert (q[1, np.arange(2), p.draft_tokens[1, :2]] > 0).all() and (q[1, :2].max(-1) < 1.0).all()
    proposer.release("g"), proposer.release("s")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    runs = [_run(engine, params)[0] for _ in range(2)]
    assert runs[0] == runs[1] and [len(r) for r in runs[0]] == MAX_TOKENS


def test_verify_gets_each_rows_own_q(engine):
    """The verify step's draft_probs are, row by row, the q the proposal drew that row's drafts from."""
    spec, v = engine.spec, CFG.vocab_size
    q = jnp.arange(2 * 2 * v, dtype=jnp.float32).reshape(2, 2, v)  # a proposal of 2 rows, k_max 2
    saved, spec._q = spec._q, {"a": (q, 1), "b": (q, 0)}
    try:
        rows = [(0, types.SimpleNamespace(request_id="b")), (4, types.SimpleNamespace(request_id="a"))]
        got = np.asarray(spec._draft_probs(rows, 4))
    finally:
        spec._q = saved
    assert got.shape == (4, K, v)
    np.testing.assert_array_equal(got[0, :2], q[0]) and np.testing.assert_array_equal(got[1, :2], q[1])
    assert not got[:, 2:].any() and not got[2:].any()  # padding rows and columns: zeros (never read)


class _FakeRequest:
    def __init__(self, temperature):
        self.sampling_params = SamplingParams(temperature=temperature, seed=3)
        self.num_output_tokens = 0
        self.output_token_ids = []


def test_config_and_checkpoint_refusals(tmp_path, heads_dir):
    with pytest.raises(ValueError, match="speculative_model is needed by.*medusa"):
        EngineConfig.from_kwargs(speculative_method="medusa", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="not a heads checkpoint"):
        load_heads(str(tmp_path / "missing"))
    heads, notes = load_heads(heads_dir)
    assert heads.cfg.num_heads == K and notes == {"note": "random"}
    model = random_model(CFG, jnp.float32, seed=7)
    from serving.engine.runner import ModelRunner

    runner = ModelRunner(
        model,
        num_blocks=4,
        block_size=16,
        max_num_seqs=1,
        max_num_batched_tokens=16,
        max_model_len=32,
        attention_backend="xla",
    )
    with pytest.raises(ValueError, match="num_speculative_tokens=4 exceeds the 3 heads"):
        MedusaProposer(heads, runner, 4)
    other = MedusaHeads(HeadsConfig(K, CFG.hidden_size + 8, CFG.vocab_size))
    with pytest.raises(ValueError, match="do not fit the target"):
        MedusaProposer(other, runner, K)


def test_training_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    from serving import train_heads
    from serving.engine.llm import LLM

    llm = LLM.from_model(random_model(CFG, jnp.float32, seed=3), NullTokenizer(), **{**OPTIONS, "max_num_seqs": 4})
    prompts = [RNG.integers(3, CFG.vocab_size, 8).tolist() for _ in range(4)]
    cfg = train_heads.TrainConfig(num_heads=2, steps=12, lr=3e-2, batch_positions=32, top_k=8, eval_fraction=0.0)
    history = train_heads.run(llm, prompts, 16, 0.0, cfg, str(tmp_path / "h"), log=lambda *_: None)
    loss = history["loss"]
    assert len(loss) == 12 and np.mean(loss[-3:]) < np.mean(loss[:3]) - 0.1, loss
    heads, notes = load_heads(str(tmp_path / "h"))
    assert heads.cfg == HeadsConfig(2, CFG.hidden_size, CFG.vocab_size) and notes["steps"] == 12
    assert np.abs(np.asarray(heads.w[...])).max() > 0  # trained away from the zero start


def _medusa_first_tokens(engine, heads, hist: list[int], st_row: dict, n: int):
    """(first emitted tokens [n], loop stats) of n rows with the same history through one medusa loop iteration (serving/spec/device_loop.py), every row starting from the target's
    own hidden state at position len(hist) - 2 and drawing its drafts from the heads' q with its own seed."""
    r = engine.runner
    bs, t = r.block_size, len(hist)
    table = list(range(1, 1 + -(-(t + K + 1) // bs)))
    r.forward([RowInput(hist[:-1], 0, table)])  # the history's KV but the last token's (the loop writes it)
    model = nnx.merge(r.graphdef, r.params)
    h = model(jnp.asarray([hist]), jnp.arange(t)[None], None, NoCache(jnp.array([t])), return_hidden=True)[2][0, t - 2]
    graph, state = nnx.split(heads)
    fn = device_loop.spec_loop_fn(r, 1, K, ("medusa", graph))
    st = SamplingTensors.from_rows([dict(st_row, seed=i) for i in range(n)])
    tail = np.zeros((n, 128), np.int32)
    tail[:, 0] = hist[-1]
    ones, tables = np.ones(n, np.int32), np.tile(np.asarray(table, np.int32), (n, 1))
    args = (tail, ones, np.full(n, t - 1, np.int32), tables, np.full(n, K + 1, np.int32), ones)
    stops = np.full((n, device_loop.MAX_STOP_IDS), -1, np.int32)
    hs, has = jnp.tile(h[None], (n, 1)), np.ones(n, bool)
    tok, (stats, _, _), r.kv_cache, _ = fn(r.params, r.kv_cache, *args, stops, st, state, hs, has)
    stats = np.asarray(stats)
    assert np.all(stats[1] == K)  # every row drafted
    return np.asarray(tok)[0], stats


def test_medusa_loop_first_token_distribution_is_the_targets(engine, monkeypatch):
    """Sampled rows through the loop: the first emitted token follows the target's processed distribution p
    (chi-square over 2,048 seeds), with drafts drawn from the heads' q (not one-hot: the rejection rule's residual
    branch runs); accepting every draft instead fails the same test."""
    # Heads near zero on the state at position t - 2 give about the target's distribution of token t - 1, and this
    # target mostly repeats its last token: a history ending in a repeat makes q and p overlap (sum min(p, q) is
    # ~0.5 here) without being equal; the high temperature spreads p over its top 6 (max ~0.46).
    st_row = dict(temperature=10.0, top_k=6)
    heads = _heads(1.0)
    hist = PROMPTS[2][:19] + PROMPTS[2][18:19]
    model = nnx.merge(engine.runner.graphdef, engine.runner.params)
    logits = model(jnp.asarray([hist]), jnp.arange(20)[None], None, NoCache(jnp.array([20])))[0]
    p = np.asarray(processed_target_probs(logits[:, -1], SamplingTensors.from_rows([st_row])))[0]
    first, stats = _medusa_first_tokens(engine, heads, hist, st_row, 2048)
    assert _chi2_pvalue(np.bincount(first, minlength=p.size).astype(np.float64), p) > 0.01
    accepted = (stats[2] > 1).mean()
    assert 0.05 < accepted < 0.95, accepted  # both branches of the rule ran

    def always_accept(target_probs, draft_probs, draft_tokens, num_draft, key):  # the wrong rule: no rejection
        b, k1 = target_probs.shape[:2]
        return jnp.concatenate([draft_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1), jnp.minimum(num_draft + 1, k1)

    monkeypatch.setattr(device_loop, "rejection_sample", always_accept)
    wrong, _ = _medusa_first_tokens(engine, heads, hist, st_row, 2048)
    assert _chi2_pvalue(np.bincount(wrong, minlength=p.size).astype(np.float64), p) < 1e-6
