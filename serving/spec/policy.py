"""When to speculate and how far: the adaptive policy, as a pure object (no JAX), and the step-cost model it is
judged by.

Speculation trades compute for latency: a verify pass over k+1 tokens per row reads the weights once, so while
decode is memory-bound the extra tokens ride almost free and each pass emits (1 - a^(k+1)) / (1 - a) tokens; as
the batch grows the step becomes compute-bound, the rejected drafts cost real time, and speculation starts to lose
throughput. The policy therefore decides, every step, a draft budget k_r per running request r:

    k_r = dither(load_factor(B) * tier(a_r), r)

  * a_r: the request's per-token acceptance, an EMA over its verified drafts. Each pass with d drafts and m
    accepted is m successes out of m + [m < d] Bernoulli trials (acceptance stops at the first rejection, so later
    drafts were never tested); successes and trials are decayed by `ema_decay` per pass and a_r is their ratio,
    started from `prior_acceptance` with `prior_weight` trials.
  * tier(a): the largest tier t (e.g. 1/3/5/7) whose last draft is still accepted with probability
    a^t >= `min_accept_prob` (the expected gain of the t-th draft is a^t tokens); at least the smallest tier, so
    every request keeps being measured. With `probe_every` = n > 0, a request whose even smallest tier fails
    (a^t0 < min_accept_prob: drafting costs more than it wins, e.g. a weak draft model) drafts only on every n-th
    step, a probe that keeps its EMA current so it can climb back.
  * load_factor(B), B the running batch: 1 up to B0 = threshold / ramp_ratio, 0 from the threshold on, and
    log(threshold / B) / log(ramp_ratio) in between: k shrinks geometrically in B instead of falling off a cliff.
    Why geometric: in the memory-bound regime plain throughput grows like B, so each +1 in B buys a factor
    (B + 1) / B; a ramp spanning a factor `ramp_ratio` in B absorbs a speculation gain of up to about
    `ramp_ratio` without throughput ever dropping (a K-by-batch table loses the whole gain at one batch size:
    tests/test_spec_policy.py shows both).
  * dither: k = floor(x + o_r) with a fixed per-request offset o_r in [0, 1), so the batch's mean k follows x
    smoothly while each request's k is stable from step to step.

Choose `batch_threshold` near the break-even batch that the benchmark measures (where speculation's gain is 1;
`StepCostModel.break_even_batch` gives it for a cost model); below it, `ramp_ratio` should be at least the
speculation gain at the threshold.

The cost model (`StepCostModel`), in units of a one-token single-row step:
    step_cost(N) = max(1, N / knee_tokens) + per_token * (N - 1) + draft_per_token * D
for N query tokens in the step (sum over rows of 1 + k_r) and D draft tokens: the roofline (the weight read
floors the step at 1 until the knee, the tokens per step at which compute time equals the weight read; compute
grows linearly after it), a per-token cost that does not amortise (KV reads, activations, sampling; the default
0.0375 is the target of a 5-token verify at 1.15x a one-token step), and the proposer's cost (0 for n-gram; a
draft model's cost per draft token relative to a target step). The default knee, 200 tokens, is about an 8B bf16
model on an H200 (about 1 PFLOP/s over 4.8 TB/s, 2 FLOPs and 2 bytes per parameter per token). Tokens per unit
cost = sum_r (1 - a_r^(k_r+1)) / (1 - a_r) / step_cost.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Hashable, Sequence


def expected_tokens(acceptance: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens one verify pass emits with k drafts accepted i.i.d. with probability a."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclasses.dataclass(frozen=True)
class SpecPolicyConfig:
    """Options of the adaptive policy (see the module docstring for what each does)."""

    batch_threshold: int = 32
    ramp_ratio: float = 4.0
    tiers: tuple[int, ...] = (1, 3, 5, 7)
    min_accept_prob: float = 0.3
    ema_decay: float = 0.8
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0
    probe_every: int = 0

    def __post_init__(self):
        if self.batch_threshold < 1:
            raise ValueError(f"batch_threshold must be >= 1, got {self.batch_threshold}")
        if self.ramp_ratio < 1.0:
            raise ValueError(f"ramp_ratio must be >= 1 (1 = no ramp), got {self.ramp_ratio}")
        if not self.tiers or any(t < 1 for t in self.tiers) or list(self.tiers) != sorted(set(self.tiers)):
            raise ValueError(f"tiers must be increasing positive draft counts, got {self.tiers}")
        if not 0.0 < self.min_accept_prob <= 1.0:
            raise ValueError(f"min_accept_prob must be in (0, 1], got {self.min_accept_prob}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {self.prior_acceptance}")
        if self.prior_weight <= 0.0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if self.probe_every < 0:
            raise ValueError(f"probe_every must be >= 0 (0: always draft the smallest tier), got {self.probe_every}")

    @property
    def max_k(self) -> int:
        return self.tiers[-1]


@dataclasses.dataclass
class _RequestStats:
    successes: float
    trials: float
    skipped: int = 0  # steps since the last probe, while below the smallest tier


class SpecPolicy:
    """Per-request draft budgets from load and acceptance. Host state only: call `num_speculative_tokens` when
    scheduling a step, `observe` after each verify, `release` when a request leaves."""

    def __init__(self, config: SpecPolicyConfig | None = None):
        self.config = config or SpecPolicyConfig()
        self._stats: dict[Hashable, _RequestStats] = {}
        self.passes = 0  # verify passes observed (with >= 1 draft)
        self.drafted = 0
        self.accepted = 0

    # Decisions ---------------------------------------------------------------------------------------------------

    def acceptance(self, request_id: Hashable) -> float:
        """The request's estimated per-token acceptance (the prior until it has been observed)."""
        s = self._stats.get(request_id)
        if s is None:
            return self.config.prior_acceptance
        return s.successes / s.trials

    def tier(self, request_id: Hashable) -> int:
        a = self.acceptance(request_id)
        best = self.config.tiers[0]
        for t in self.config.tiers:
            if a**t >= self.config.min_accept_prob:
                best = t
        return best

    def load_factor(self, batch_size: int) -> float:
        """1 for a small batch, 0 from the threshold on, geometric in between."""
        c = self.config
        if batch_size >= c.batch_threshold:
            return 0.0
        if c.ramp_ratio <= 1.0:
            return 1.0
        return min(1.0, math.log(c.batch_threshold / max(batch_size, 1)) / math.log(c.ramp_ratio))

    def num_speculative_tokens(self, request_ids: Sequence[Hashable], batch_size: int | None = None) -> list[int]:
        """The draft budget of each request this step; `batch_size` defaults to len(request_ids)."""
        f = self.load_factor(len(request_ids) if batch_size is None else batch_size)
        if f == 0.0:
            return [0] * len(request_ids)
        return [
            0 if self._resting(r) else min(self.tier(r), math.floor(f * self.tier(r) + _offset(r))) for r in request_ids
        ]

    def _resting(self, request_id: Hashable) -> bool:
        """Below the smallest tier with probing on: True except on every probe_every-th call."""
        c, s = self.config, self._stats.get(request_id)
        if not c.probe_every or s is None or self.acceptance(request_id) ** c.tiers[0] >= c.min_accept_prob:
            return False
        s.skipped += 1
        if s.skipped < c.probe_every:
            return True
        s.skipped = 0
        return False

    # Feedback ----------------------------------------------------------------------------------------------------

    def observe(self, request_id: Hashable, num_draft: int, num_accepted: int) -> None:
        """A verify pass of `request_id` kept `num_accepted` of its `num_draft` drafts."""
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"num_accepted must be in [0, num_draft={num_draft}], got {num_accepted}")
        if num_draft == 0:
            return
        c = self.config
        s = self._stats.get(request_id)
        if s is None:
            s = self._stats[request_id] = _RequestStats(c.prior_acceptance * c.prior_weight, c.prior_weight)
        s.successes = c.ema_decay * s.successes + num_accepted
        s.trials = c.ema_decay * s.trials + num_accepted + (1 if num_accepted < num_draft else 0)
        self.passes += 1
        self.drafted += num_draft
        self.accepted += num_accepted

    def release(self, request_id: Hashable) -> None:
        self._stats.pop(request_id, None)

    @property
    def tracked(self) -> set:
        """Requests with acceptance state (the engine releases those that left)."""
        return set(self._stats)

    def metrics(self) -> dict[str, float]:
        """Totals for /metrics: passes with drafts, drafted and accepted tokens, acceptance, emitted per pass."""
        return dict(
            passes=self.passes,
            drafted=self.drafted,
            accepted=self.accepted,
            draft_acceptance=self.accepted / self.drafted if self.drafted else 0.0,
            emitted_per_pass=(self.accepted + self.passes) / self.passes if self.passes else 0.0,
        )


def _offset(request_id: Hashable) -> float:
    """A fixed pseudo-random offset in [0, 1) per request (stable across processes, unlike hash())."""
    return (zlib.crc32(repr(request_id).encode()) % 1_000_003) / 1_000_003


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Cost of one engine step relative to a one-token single-row step (module docstring)."""

    per_token: float = 0.0375
    knee_tokens: float = 200.0
    draft_per_token: float = 0.0

    def __post_init__(self):
        if self.per_token < 0 or self.knee_tokens <= 0 or self.draft_per_token < 0:
            raise ValueError(f"StepCostModel: per_token and draft_per_token must be >= 0, knee_tokens > 0: {self}")

    def step_cost(self, num_query_tokens: int, num_draft_tokens: int = 0) -> float:
        n = num_query_tokens
        return max(1.0, n / self.knee_tokens) + self.per_token * (n - 1) + self.draft_per_token * num_draft_tokens

    def tokens_per_cost(self, acceptances: Sequence[float], ks: Sequence[int]) -> float:
        """Expected emitted tokens per unit of step cost for rows with these acceptances and draft budgets."""
        tokens = sum(expected_tokens(a, k) for a, k in zip(acceptances, ks))
        return tokens / self.step_cost(sum(k + 1 for k in ks), sum(ks))

    def break_even_batch(self, acceptance: float, k: int, max_batch: int = 4096) -> int:
        """The smallest batch at which k drafts per row at `acceptance` no longer beat plain decoding."""
        for b in range(1, max_batch + 1):
            if self.tokens_per_cost([acceptance] * b, [k] * b) <= self.tokens_per_cost([acceptance] * b, [0] * b):
                return b
        return max_batch
