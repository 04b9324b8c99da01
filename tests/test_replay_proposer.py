"""serving/spec/proposers.py ReplayProposer through the engine (tiny random model, CPU, XLA attention).

The proposer drafts the target's recorded greedy continuation, each token corrupted with probability 1 - p; the
engine's greedy output must stay the recording (speculation is exact), and the per-token acceptance measured at
verification (successes / Bernoulli trials, a pass with d drafts and m accepted testing m + [m < d] tokens) must be
close to p: exactly 1 at p = 1 and 0 at p = 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from model.config import ModelConfig
from model.transformer import random_model
from serving.core.request import SamplingParams
from serving.spec.proposers import ProposalRow, ReplayProposer

CFG = ModelConfig.tiny(vocab_size=256, num_layers=1)
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def llm():
    from serving.engine.llm import LLM

    options = dict(
        attention_backend="xla",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        num_kv_blocks=64,
        max_model_len=128,
        speculative_method="ngram",
        num_speculative_tokens=4,
    )
    return LLM.from_model(random_model(CFG, seed=4), None, **options)


def _run(engine, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += list(o.new_token_ids)
    return [out[rid] for rid in ids]


class Recorder:
    """Wraps a proposer's observe: counts accepted drafts and Bernoulli trials per verify pass."""

    def __init__(self, proposer):
        self.proposer, self.successes, self.trials = proposer, 0, 0
        self._observe = proposer.observe
        proposer.observe = self.observe

    def observe(self, request_id, num_draft, num_accepted):
        self.successes += num_accepted
        self.trials += num_accepted + (1 if num_accepted < num_draft else 0)
        self._observe(request_id, num_draft, num_accepted)


@pytest.fixture(scope="module")
def recorded(llm):
    engine = llm.engine
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (9, 14, 20, 7, 11, 16, 5, 12)]
    saved, engine.spec = engine.spec, None  # plain greedy decoding: the recording
    try:
        outs = _run(engine, prompts)
    finally:
        engine.spec = saved
    return prompts, outs


@pytest.mark.parametrize("acceptance", [0.0, 0.4, 0.8, 1.0])
def test_replay_acceptance_is_the_set_rate_and_output_exact(llm, recorded, acceptance):
    prompts, outs = recorded
    engine = llm.engine
    proposer = ReplayProposer([p + o for p, o in zip(prompts, outs)], [len(p) for p in prompts], acceptance, 256, 1)
    saved = engine.spec.proposer
    engine.spec.proposer = proposer
    rec = Recorder(proposer)
    try:
        got = _run(engine, prompts)
    finally:
        engine.spec.proposer = saved
    assert got == outs
    assert rec.trials > (10 if acceptance == 0.0 else 80), rec.trials  # at 0 the policy backs off
    rate = rec.successes / rec.trials
    if acceptance in (0.0, 1.0):
        assert rate == acceptance, rate
    else:
        assert abs(rate - acceptance) < 3 * np.sqrt(acceptance * (1 - acceptance) / rec.trials), (rate, rec.trials)


def test_replay_drafts_and_errors():
    p = ReplayProposer([[1, 2, 3, 4, 5, 6]], [2], 1.0, 10)
    out = p.propose(
        [ProposalRow("a", [1, 2, 3], 2), ProposalRow("b", [7, 7], 2), ProposalRow("a2", [1, 2, 3, 4, 5], 3)]
    )
    assert out.draft_tokens.tolist() == [[4, 5, -1], [-1, -1, -1], [6, -1, -1]] and out.num_draft.tolist() == [2, 0, 1]
    off = ReplayProposer([[1, 2, 3, 4, 5, 6]], [2], 0.0, 10).propose([ProposalRow("a", [1, 2], 4)])
    assert all(int(t) != w for t, w in zip(off.draft_tokens[0], [3, 4, 5, 6]))
    for bad in (dict(acceptance=1.5), dict(acceptance=-0.1), dict(vocab_size=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ReplayProposer([[1, 2]], [1], **(dict(acceptance=0.5, vocab_size=10) | bad))
