"""serving/spec/policy.py: tiers from the acceptance EMA, the load ramp, and smooth throughput across the
batch threshold under the step-cost model."""

from __future__ import annotations

import random

import pytest

from serving.spec.policy import SpecPolicy, SpecPolicyConfig, StepCostModel, expected_tokens

MAX_DROP = 0.05


def _policy_with(acceptances: list[float], passes: int = 60, **config) -> SpecPolicy:
    """A policy whose request i has been observed at acceptance acceptances[i] (deterministic draws)."""
    pol = SpecPolicy(SpecPolicyConfig(**config))
    rng = random.Random(0)
    for i, a in enumerate(acceptances):
        for _ in range(passes):
            d = 7
            m = 0
            while m < d and rng.random() < a:
                m += 1
            pol.observe(i, d, m)
    return pol


def _throughput_curve(pol: SpecPolicy, acceptances: list[float], cost: StepCostModel, max_batch: int):
    """Tokens per unit step cost at batch sizes 1..max_batch (the batch holds requests 0..B-1)."""
    out = []
    for b in range(1, max_batch + 1):
        ids = list(range(b))
        ks = pol.num_speculative_tokens(ids)
        out.append(cost.tokens_per_cost(acceptances[:b], ks))
    return out


def _worst_step(curve: list[float]) -> float:
    return min(curve[i + 1] / curve[i] for i in range(len(curve) - 1))


ACCEPT = [random.Random(1).uniform(0.5, 0.9) for _ in range(256)]

# (cost model, threshold): thresholds below, at (None) and above the cost model's break-even batch.
SETTINGS = {
    "default_cost_thr_8": (StepCostModel(), 8),
    "default_cost_at_break_even": (StepCostModel(), None),
    "default_cost_thr_32": (StepCostModel(), 32),
    "cheap_tokens_0.01_thr_32": (StepCostModel(0.01, 200), 32),
    "small_knee_64_at_break_even": (StepCostModel(0.02, 64), None),
    "free_tokens_knee_256_thr_32": (StepCostModel(0.0, 256), 32),
    "draft_model_0.05_per_token_thr_16": (StepCostModel(0.0375, 200, draft_per_token=0.05), 16),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_throughput_is_smooth_across_the_threshold(name):
    cost, thr = SETTINGS[name]
    if thr is None:
        thr = cost.break_even_batch(0.7, 5)
    pol = _policy_with(ACCEPT[: 2 * thr + 8], batch_threshold=thr)
    curve = _throughput_curve(pol, ACCEPT, cost, 2 * thr + 8)
    assert _worst_step(curve) >= 1 - MAX_DROP, (thr, [round(x, 2) for x in curve])
    plain = [cost.tokens_per_cost(ACCEPT[:b], [0] * b) for b in range(1, 2 * thr + 9)]
    assert curve[0] > 1.3 * plain[0]  # the latency win at batch 1 is kept
    assert curve[thr - 1 :] == plain[thr - 1 :]  # off from the threshold on: exactly plain decoding


def test_a_k_by_batch_table_fails_the_same_check():
    """The harness can fail: a cliff (full k below the threshold, none from it on) drops throughput at the
    threshold, which is the peers' complaint."""
    cost, thr = StepCostModel(0.01, 200), 16
    cliff = _policy_with(ACCEPT[: 2 * thr + 8], batch_threshold=thr, ramp_ratio=1.0)
    assert _worst_step(_throughput_curve(cliff, ACCEPT, cost, 2 * thr + 8)) < 1 - MAX_DROP


def test_tiers_follow_acceptance():
    # Tier edges at min_accept_prob 0.3: 7 from a = 0.842, 5 from 0.786, 3 from 0.669.
    pol = _policy_with([0.95, 0.815, 0.72, 0.45, 0.1], passes=3000, ema_decay=0.995)
    assert [pol.tier(i) for i in range(5)] == [7, 5, 3, 1, 1]
    assert pol.tier("new") == 1  # the prior 0.6: 0.6^3 = 0.22 < min_accept_prob 0.3, so a new request starts low
    assert _policy_with([0.6], prior_acceptance=0.7).tier("new") == 3  # 0.7^3 = 0.34


def test_acceptance_estimate_is_unbiased_under_truncation():
    """successes / trials (trials end at the first rejection) estimates a; accepted / drafted would not."""
    for a in (0.3, 0.6, 0.85):
        pol = _policy_with([a], passes=3000, ema_decay=0.999)
        assert abs(pol.acceptance(0) - a) < 0.03, (a, pol.acceptance(0))
        assert pol.accepted / pol.drafted < a - 0.05  # the naive ratio is biased low


def test_ema_follows_a_change_in_acceptance():
    pol = _policy_with([0.95])
    assert pol.tier(0) == 7
    for _ in range(20):
        pol.observe(0, 7, 0)  # every first draft rejected
    assert pol.tier(0) == 1 and pol.acceptance(0) < 0.2
    pol.release(0)
    assert pol.acceptance(0) == pol.config.prior_acceptance


def test_load_factor_and_dithered_budgets():
    pol = _policy_with([0.95] * 400, passes=20, batch_threshold=32, ramp_ratio=4.0)
    f = [pol.load_factor(b) for b in range(1, 40)]
    assert f[:8] == [1.0] * 8 and all(x == 0.0 for x in f[31:])
    assert all(f[i + 1] <= f[i] for i in range(len(f) - 1))
    assert abs(pol.load_factor(16) - 0.5) < 1e-9  # halfway (geometrically) between 8 and 32
    ids = list(range(400))
    ks = pol.num_speculative_tokens(ids, batch_size=16)
    assert all(0 <= k <= 7 for k in ks)
    assert abs(sum(ks) / len(ks) - 0.5 * 7) < 0.3  # dithering: the mean follows f * tier
    assert ks == pol.num_speculative_tokens(ids, batch_size=16)  # stable per request
    assert pol.num_speculative_tokens(ids[:3]) == [7, 7, 7]  # batch 3 < 8: full tier
    assert pol.num_speculative_tokens(ids[:40]) == [0] * 40


def test_observe_validation_and_metrics():
    pol = SpecPolicy()
    with pytest.raises(ValueError, match="num_accepted"):
        pol.observe("r", 3, 4)
    pol.observe("r", 0, 0)  # no drafts: nothing learned
    assert pol.metrics()["passes"] == 0 and pol.acceptance("r") == pol.config.prior_acceptance
    pol.observe("r", 4, 2)
    pol.observe("r", 4, 4)
    m = pol.metrics()
    assert (m["passes"], m["drafted"], m["accepted"]) == (2, 8, 6)
    assert m["draft_acceptance"] == 0.75 and m["emitted_per_pass"] == 4.0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(batch_threshold=0), "batch_threshold"),
        (dict(ramp_ratio=0.5), "ramp_ratio"),
        (dict(tiers=(3, 1)), "tiers"),
        (dict(tiers=()), "tiers"),
        (dict(min_accept_prob=0.0), "min_accept_prob"),
        (dict(ema_decay=1.0), "ema_decay"),
        (dict(prior_acceptance=1.5), "prior_acceptance"),
        (dict(prior_weight=0.0), "prior_weight"),
    ],
)
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecPolicyConfig(**kw)


def test_cost_model():
    cost = StepCostModel(per_token=0.05, knee_tokens=100)
    assert cost.step_cost(1) == 1.0
    assert abs(cost.step_cost(5) - 1.2) < 1e-12  # memory-bound: 1 + 0.05 * 4
    assert abs(cost.step_cost(401) - (4.01 + 20.0)) < 1e-9  # past the knee: 401 / 100, plus 0.05 * 400
    assert abs(StepCostModel(draft_per_token=0.1).step_cost(5, 4) - (1.15 + 0.4)) < 1e-12
    with pytest.raises(ValueError, match="knee_tokens"):
        StepCostModel(knee_tokens=0)
    assert abs(expected_tokens(0.8, 4) - (1 - 0.8**5) / 0.2) < 1e-12 and expected_tokens(1.0, 3) == 4.0
    b = cost.break_even_batch(0.8, 4)
    assert cost.tokens_per_cost([0.8] * (b - 1), [4] * (b - 1)) > cost.tokens_per_cost([0.8] * (b - 1), [0] * (b - 1))
    assert cost.tokens_per_cost([0.8] * b, [4] * b) <= cost.tokens_per_cost([0.8] * b, [0] * b)


def test_a_request_below_the_smallest_tier_only_probes():
    pol = SpecPolicy(SpecPolicyConfig(probe_every=4))
    for _ in range(10):
        pol.observe("weak", 1, 0)  # never accepted: a -> 0, a^1 < min_accept_prob
    pol.observe("good", 3, 3)
    ks = [pol.num_speculative_tokens(["weak", "good"]) for _ in range(12)]
    assert [k[0] for k in ks] == [0, 0, 0, 1] * 3  # a probe every 4th step keeps the EMA current
    assert all(k[1] >= 1 for k in ks)
    for _ in range(10):
        pol.observe("weak", 1, 1)  # it got better: drafts every step again
    assert all(pol.num_speculative_tokens(["weak"])[0] >= 1 for _ in range(4))
    off = SpecPolicy(SpecPolicyConfig())  # probe_every 0: the smallest tier on every step, however bad
    for _ in range(10):
        off.observe("weak", 1, 0)
    assert [off.num_speculative_tokens(["weak"])[0] for _ in range(4)] == [1] * 4
