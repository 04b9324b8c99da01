"""What the scheduler hands the engine each step: result types at its boundary (pure Python, no JAX).

`Scheduler.schedule` returns a `SchedulerOutput` (the rows to compute, page copies, preemptions); the engine runs
it and hands `Scheduler.update` one `StepResult` (per row: tokens, logprobs, positions computed, finish reason),
which each `ScheduledRequest` validates (`check_tokens`) before the scheduler changes anything. `SchedulerStats` is the snapshot for metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from serving.core.kv_manager import Allocation
from serving.core.request import FinishReason, Request


class RequestRejected(ValueError):
    """Raised by `add_request` for a request that can never be served; the request is marked finished
    ('error') with the reason as its finish_message."""


@dataclasses.dataclass
class ScheduledRequest:
    """One request's work in a step.

    Attributes:
        request: the request (read its sampling params and token history; do not mutate it).
        token_ids: tokens whose KV is computed this step, at positions start_pos .. start_pos + len - 1.
        start_pos: num_computed_tokens before the step.
        block_table: block ids covering positions 0 .. start_pos + len(token_ids) - 1.
        sample: whether a token is sampled from the logits of the last position (the chunk reaches the end of
            the known tokens); otherwise this is a non-final prefill chunk.
        num_draft: draft tokens at the end of token_ids (0: none), to verify from the logits of the last
            1 + num_draft positions; `update` then takes 1 .. num_draft + 1 tokens.
    """

    request: Request
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    num_draft: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def check_tokens(self, tokens: Sequence[int], n_computed: int | None) -> None:
        """Validates what `Scheduler.update` got for this row (see its Args).

        Raises:
            ValueError: a sampled row without tokens, tokens for a non-final chunk, more tokens than drafts + 1,
                accepted tokens that are not the drafts, or `computed` out of range (or given for drafts).
        """
        rid = self.request_id
        if self.sample and not tokens:
            raise ValueError(f"request {rid!r} was sampled this step but got no token")
        if tokens and not self.sample:
            raise ValueError(f"request {rid!r} got tokens for a non-final prefill chunk")
        n = len(self.token_ids)
        if self.num_draft:
            drafts = self.token_ids[n - self.num_draft :]
            if n_computed is not None or len(tokens) > self.num_draft + 1:
                raise ValueError(
                    f"request {rid!r}: {len(tokens)} tokens (computed={n_computed}) for {self.num_draft} drafts"
                )
            if list(tokens[:-1]) != drafts[: len(tokens) - 1]:
                raise ValueError(f"request {rid!r}: accepted tokens {list(tokens[:-1])} are not a prefix of {drafts}")
        elif n_computed is not None and not n <= n_computed <= n + max(len(tokens) - 1, 0):
            raise ValueError(
                f"request {rid!r}: computed={n_computed} for {n} scheduled and {len(tokens)} sampled tokens"
            )


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled: per-request work, decode rows first.
        cow_pairs: (src, dst) pages the runner copies before the step's KV writes.
        preempted_ids: requests preempted this step (they lost their KV and wait to be recomputed).
        num_batched_tokens: sum of len(token_ids) over scheduled, drafts included (<= max_num_batched_tokens).
    """

    scheduled: list[ScheduledRequest] = dataclasses.field(default_factory=list)
    cow_pairs: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted_ids: list[str] = dataclasses.field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def take(self, alloc: Allocation) -> bool:
        """Records an allocation's page copies for the runner; returns whether it succeeded."""
        self.cow_pairs.extend(alloc.cow_pairs)
        return alloc.ok


@dataclasses.dataclass
class RowResult:
    """What one scheduled row produced in a step.

    Attributes:
        token_ids: tokens sampled for the row: one for a decode row or a prompt's last chunk; a verify row's
            accepted drafts and its bonus / correction token; a k-step loop's tokens; none for a non-final chunk.
        logprobs: one entry per token (when the request asked for logprobs), else None.
        num_computed: positions whose KV the step wrote from start_pos on, when more than the scheduled tokens (a
            k-step loop writes the scheduled token and the first k - 1 sampled ones); None: the scheduled tokens.
        finish_reason: set once the step's tokens finished the request (the request's token stops in
            `Scheduler.update`, text stops and grammar verdicts in the engine's output processor).
    """

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] | None = None
    num_computed: int | None = None
    finish_reason: FinishReason | None = None


@dataclasses.dataclass
class StepResult:
    """One step's outcome: the plan it ran and one `RowResult` per scheduled row, in the plan's order."""

    plan: SchedulerOutput
    rows: list[RowResult]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.plan.scheduled):
            raise ValueError(f"{len(self.rows)} row results for {len(self.plan.scheduled)} scheduled rows")

    def __iter__(self):
        """(ScheduledRequest, RowResult) pairs."""
        return iter(zip(self.plan.scheduled, self.rows))

    @classmethod
    def build(
        cls,
        plan: SchedulerOutput,
        sampled: Mapping[str, Sequence[int]],
        logprobs: Mapping[str, Sequence[Any]] | None = None,
        computed: Mapping[str, int] | None = None,
    ) -> StepResult:
        """From per-request mappings (request id -> tokens / logprob entries / positions computed)."""
        rows = []
        for sr in plan.scheduled:
            rid = sr.request_id
            lps = logprobs.get(rid) if logprobs else None
            n = computed.get(rid) if computed else None
            rows.append(RowResult(list(sampled.get(rid, ())), None if lps is None else list(lps), n))
        return cls(plan, rows)


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics. Prefix counters count each request's first admission only."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
