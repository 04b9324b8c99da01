"""Speculative decoding through the engine, on the default model (SmolLM2, float32, CPU, XLA attention).

One LLM (n-gram speculation, k <= 3) serves the module; the other proposers are SpecDecoders swapped in over the
same engine and runner (self-speculation on the target's first layers, and a draft model with its own paged KV:
a truncated copy of SmolLM2, so its acceptance is high and its output checkable), and `engine.spec = None` is
plain decoding, the reference. Greedy output must be token-identical with and without speculation, under prefix
caching, chunked prefill (budget 32 < prompt lengths) and forced preemption (a 20-block pool); every KV block is
back (only the prefix cache holds blocks) after runs with many rejections.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from serving.core.request import SamplingParams
from serving.core.scheduler import Scheduler
from serving.spec.draft_model import ModelDraftProposer, make_model_proposer, runner_like, truncated_model
from serving.spec.policy import SpecPolicy, SpecPolicyConfig
from serving.spec.verify import SpecDecoder, _banned_per_position, policy_config

MAX_MODEL_LEN = 160
OPTIONS = dict(
    attention_backend="xla",
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=16,
    num_kv_blocks=96,
    decode_steps=4,  # steps without drafts run as on-device loops: speculation and loops alternate
    speculative_method="ngram",
    num_speculative_tokens=3,
)
COPY_TEXT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def llm():
    from serving.engine.llm import LLM

    return LLM(max_model_len=MAX_MODEL_LEN, **OPTIONS)


@pytest.fixture(scope="module")
def prompts(llm):
    """Copy-heavy chat prompts (the n-gram proposer hits), one sharing a prefix with another, one of 60 tokens."""
    ask = [
        f"Repeat this code exactly:\n{COPY_TEXT}",
        f"Repeat this code exactly:\n{COPY_TEXT}Now add mul.",
        "Count from one to twelve in words, separated by commas.",
    ]
    out = [llm.encode_prompt(a, chat=True) for a in ask]
    rng = np.random.default_rng(0)
    return out + [rng.integers(100, 40000, 60).tolist()]


MAX_TOKENS = [40, 36, 30, 12]


def _use_scheduler(engine, **overrides) -> Scheduler:
    c = engine.config
    args = dict(
        num_blocks=engine.runner.num_blocks,
        block_size=c.block_size,
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        enable_prefix_caching=True,
    )
    engine.scheduler = Scheduler(**(args | overrides))
    return engine.scheduler


@contextlib.contextmanager
def _speculating(engine, spec):
    saved = engine.spec
    engine.spec = spec
    try:
        yield spec
    finally:
        engine.spec = saved


def _decoder(engine, proposer) -> SpecDecoder:
    return SpecDecoder(
        engine.scheduler, engine.runner, engine.sampler, engine.outputs, proposer, 3, SpecPolicy(policy_config(3, 0))
    )


def _run(engine, requests):
    """Steps until every request finishes; returns (tracks, the most tokens one request got in one step)."""
    rids = [engine.add_request(ids, params) for ids, params in requests]
    most = 0
    while engine.has_unfinished():
        for o in engine.step():
            most = max(most, len(o.new_token_ids))
        engine.scheduler.check_invariants()
    sched = engine.scheduler
    assert sched.block_manager.num_used == (sched.cache.num_cached_blocks if sched.cache is not None else 0)
    return [engine.pop_finished(r) for r in rids], most


@pytest.fixture(scope="module")
def reference(llm, prompts):
    engine = llm.engine
    _use_scheduler(engine)
    with _speculating(engine, None):
        tracks, _ = _run(
            engine, [(p, SamplingParams(max_tokens=m, temperature=0.0)) for p, m in zip(prompts, MAX_TOKENS)]
        )
    return [t.request.output_token_ids for t in tracks]


@pytest.fixture(scope="module")
def proposers(llm):
    """name -> proposer over the module's engine: n-gram, self-speculation (L = 20 of 30), a draft model with its
    own pool (SmolLM2's first 26 layers, a truncated copy) and a weak self-draft (4 layers: many rejections)."""
    engine, model = llm.engine, llm.model
    r = engine.runner
    copy = runner_like(r, truncated_model(model, 26))
    spec = engine.config.speculative

    def self_spec(layers):
        import dataclasses

        return make_model_proposer(
            "self", r, model, dataclasses.replace(spec, method="self", speculative_draft_layers=layers), None
        )

    return dict(
        ngram=engine.spec.proposer, self=self_spec(20), draft=ModelDraftProposer(copy, "draft"), weak=self_spec(4)
    )


@pytest.mark.parametrize("name", ["ngram", "self", "draft", "weak", "draft_host"])
def test_greedy_identical_with_prefix_cache_chunked_prefill_and_preemption(
    llm, prompts, reference, proposers, name, monkeypatch
):
    """Every proposer drafts inside the on-device loop where a step allows it (decode rows only) and verifies on
    the host otherwise; "draft_host" verifies every pass on the host."""
    engine = llm.engine
    sched = _use_scheduler(engine, num_blocks=12)  # 11 blocks of 16 for 4 requests of 72-110 tokens
    loops_before, spec_loops_before = engine.num_decode_loops, engine.spec_loops.num_loops
    monkeypatch.setattr(engine.spec_loops, "enabled", name != "draft_host")  # restored even when an assert fails
    with _speculating(engine, _decoder(engine, proposers[name.removesuffix("_host")])) as spec:
        tracks, most = _run(
            engine, [(p, SamplingParams(max_tokens=m, temperature=0.0)) for p, m in zip(prompts, MAX_TOKENS)]
        )
        assert engine.step() == []  # an idle step releases the state kept for finished requests
    assert (engine.spec_loops.num_loops > spec_loops_before) == (name != "draft_host")
    assert not spec.policy.tracked and not getattr(spec.proposer, "tracked", set())
    for i, t in enumerate(tracks):
        assert t.request.output_token_ids == reference[i], f"{name}: request {i}"
    m = spec.counters.as_dict()
    assert sched.num_preemptions > 0 and sched.stats().prefix_hit_tokens > 0
    assert m["passes"] > 0 and m["emitted"] == m["accepted"] + m["passes"]
    assert m["accepted"] < m["drafted"]  # some drafts were rejected (and rolled back: the block check in _run)
    if name in ("ngram", "draft", "draft_host"):
        assert most > 1 and m["acceptance_rate"] > 0.3  # several tokens per step reach the stream
    if name == "weak":  # many rejections; then the policy rests the requests (probes only) and loops decode
        assert m["drafted"] - m["accepted"] > 5 and engine.num_decode_loops > loops_before


def test_stops_min_tokens_penalties_and_seeds_act_as_without_speculation(llm, prompts):
    engine = llm.engine
    p = prompts[0]
    cases = [
        SamplingParams(max_tokens=40, stop=("return a - b",), temperature=0.0),
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=20, min_tokens=18, stop_token_ids=(28,), temperature=0.0),
        SamplingParams(max_tokens=16, repetition_penalty=1.3, temperature=0.0),
        SamplingParams(max_tokens=16, logprobs=2, temperature=0.0),
    ]

    def outputs():
        _use_scheduler(engine)
        tracks, _ = _run(engine, [(p, c) for c in cases])
        return [(t.request.output_token_ids, t.text, t.request.finish_reason) for t in tracks]

    with _speculating(engine, None):
        plain = outputs()
    spec = engine.spec
    with _speculating(engine, spec):
        before = spec.counters.passes
        speculative = outputs()
        assert spec.counters.passes > before
    for i, (a, b) in enumerate(zip(plain, speculative)):
        assert a == b, f"case {i}: {cases[i]}"
    assert plain[0][2] == "stop" and "return a - b" not in plain[0][1]  # the stop string ended it, cut from the text
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    runs = []
    for _ in range(2):
        _use_scheduler(engine)
        tracks, _ = _run(engine, [(p, seeded)])
        runs.append(tracks[0].request.output_token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_speculation_stops_at_the_batch_threshold(llm, prompts):
    engine = llm.engine
    spec = engine.spec
    saved = spec.policy
    spec.policy = SpecPolicy(SpecPolicyConfig(batch_threshold=2, ramp_ratio=1.0, tiers=(1, 3)))  # below 2 running
    sched = _use_scheduler(engine)
    original, seen = sched.schedule, []

    def spy():
        running = len(sched.running)
        out = original()
        seen.append((running, any(sr.num_draft for sr in out.scheduled)))
        return out

    sched.schedule = spy
    # rows of each on-device speculative loop (serving/spec/device_loop.py)
    loops, dispatch = [], engine.spec_loops.dispatch
    engine.spec_loops.dispatch = lambda reqs, *a: loops.append(len(reqs)) or dispatch(reqs, *a)
    try:
        _run(engine, [(prompts[0], SamplingParams(max_tokens=m, temperature=0.0)) for m in (8, 16, 30)])
    finally:
        spec.policy = saved
        del engine.spec_loops.dispatch
    assert not any(drafts for running, drafts in seen if running >= 2) and all(n < 2 for n in loops)
    assert loops or any(drafts for running, drafts in seen if running < 2)  # the last request, alone, speculates


def test_policy_tiers_and_bans():
    assert policy_config(3, 0).tiers == (1, 3) and policy_config(7, 8).tiers == (1, 3, 5, 7)
    assert policy_config(4, 0).tiers == (1, 3, 4) and policy_config(1, 0).batch_threshold > 1 << 20

    class _Req:
        eos_token_ids = (2,)
        num_output_tokens = 3
        sampling_params = SamplingParams(max_tokens=10, min_tokens=5, stop_token_ids=(9,))

    banned = _banned_per_position(_Req(), 4)  # positions 0, 1 are outputs 4, 5 (< min_tokens 5 at 3 + j)
    assert banned[0, :2].tolist() == [9, 2] and banned[1, :2].tolist() == [9, 2]
    assert (banned[2:] == -1).all()


def test_truncated_model_shares_the_target_arrays(llm):
    from flax import nnx

    draft = truncated_model(llm.model, 3)
    ours = dict(nnx.to_flat_state(nnx.state(draft)))
    theirs = dict(nnx.to_flat_state(nnx.state(llm.model)))
    assert draft.cfg.num_layers == 3 and set(ours) < set(theirs)
    assert any(p[0] == "layers" and p[1] == 2 for p in ours) and not any(p[:2] == ("layers", 3) for p in ours)
    # the same arrays (fused q|k|v and gate|up slots included), not copies
    assert all(ours[p][...] is theirs[p][...] for p in ours)
    with pytest.raises(ValueError, match="speculative_draft_layers"):
        truncated_model(llm.model, llm.model.cfg.num_layers)


def test_acceptance_metrics_reach_prometheus():
    from serving.api.async_engine import EngineStats
    from serving.api.metrics import ServerMetrics
    from serving.spec.verify import SpecCounters

    counters = SpecCounters(passes=4, drafted=10, accepted=8, emitted=12)
    text = ServerMetrics(lambda: EngineStats(speculative={"ngram": counters.as_dict()})).render().decode()
    assert 'pallas_serve_spec_draft_tokens_total{method="ngram"} 10.0' in text
    assert 'pallas_serve_spec_accepted_tokens_total{method="ngram"} 8.0' in text
    assert 'pallas_serve_spec_acceptance_rate{method="ngram"} 0.8' in text
    assert 'pallas_serve_spec_mean_emitted_per_pass{method="ngram"} 3.0' in text
    assert "spec_" not in ServerMetrics(lambda: EngineStats()).render().decode()  # off: no series
