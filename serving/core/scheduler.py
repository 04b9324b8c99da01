"""Iteration-level scheduler under a token budget (pure Python, no JAX).

One step of the engine:

    (engine sets request.spec_token_ids on decode rows it has drafts for)
    out = scheduler.schedule()                  # which tokens of which requests to compute, and where
    ...runner copies out.cow_pairs pages, computes out.scheduled, samples (or verifies) rows with .sample...
    done = scheduler.update(out, {request_id: [token, ...]})

Between steps the engine may call add_request (raises RequestRejected for a request that never fits), abort /
finish (any state; blocks released), stats(); within a step, reserve_lookahead before a multi-step decode loop.

There is one path for every kind of work, as in vLLM v1: a request needs `num_tokens - num_computed_tokens`
more positions computed. A fresh prompt needs all of them (minus prefix-cache hits), a decode row needs 1 (the
token sampled last step) plus its draft tokens, a request resumed after preemption needs its prompt and outputs
again. Each step:

1. Running requests, decode rows (one token left) first, then unfinished prefills, each group oldest first.
   Each takes min(remaining, budget left, long_prefill_token_threshold) tokens (prefill rows, admissions
   included, at most max_prefill_tokens_while_decoding in all when the step has decode rows; a running prompt's
   chunk at most prefill_share_while_waiting of the budget while a waiting request could start); a decode row with
   k drafts takes 1 + k, the drafts trimmed to the budget (less one token per later decode row), max_model_len and
   max_tokens. When blocks run out the youngest unscheduled running request is preempted by recompute (its
   committed full blocks go to the prefix cache, its references are dropped, it returns to the front of the waiting
   queue with num_computed_tokens = 0). Blocks for drafts are taken only after every running row has its own, as many drafts as fit, so drafts
   never cause a preemption (budget of drafts that do not fit goes back to admission).
   No livelock: a request resumed after preemption is protected until it samples a new token. It is never a
   victim; when it is short of blocks itself and only protected requests are left to preempt, it waits (keeping
   its blocks) while unprotected requests run or preempt themselves. Only when a whole step would schedule
   nothing (every running request protected and blocked) is protection dropped for that step. So each
   preemption of a request is followed by a new token of it, and every step makes progress.
2. If nothing was preempted, waiting requests in FCFS order (or by priority, then arrival), while slots, budget
   and blocks last. Admission takes the cached prefix of `all_token_ids[:-1]` (KVManager.lookup_prefix). A
   request starts only when blocks for all its known tokens are free or evictable (it then allocates chunk by
   chunk), so half-computed prefills do not fill the pool and preempt each other. A request that cannot start
   stays at the head of the queue (admission never preempts, so priority orders admission and victims but does
   not evict running requests). Requests that could never fit (prompt over max_model_len, more blocks than the
   pool) are refused by `add_request` instead of waiting forever. Each request is one sequence
   (the server fans n choices out into requests sharing the prompt through the prefix cache). SamplingParams
   arrive validated: they are checked once, where they enter (LLM.generate, the server's request conversion).

Speculative verification of a decode row, and what `update` does with it:

    positions   start   start+1  start+2  start+3         start = num_computed_tokens
    scheduled   t0      d1       d2       d3              num_draft = 3, 4 tokens of budget
    verified    d1 ok   d2 ok    d3 bad -> correction c   update gets [d1, d2, c]
    after       num_computed = start + 3 (t0 d1 d2); outputs += [d1, d2, c]; the KV at start+3 is garbage,
                blocks past ceil((start + 3) / block_size) are rolled back; c is computed next step

Block tables, copy-on-write, the prefix cache and provisional positions are the KVManager's (kv_manager.py):
the scheduler asks it for capacity and never touches a block itself. Block 0 is the null page, never in a table.

Stop conditions at the token level (EOS unless ignore_eos, stop_token_ids, both only once min_tokens outputs
exist; max_tokens; max_model_len) are checked in `update`, token by token over a row's tokens (so accepted
drafts stop exactly where one-at-a-time decoding would). Stop strings are the engine's: it calls `finish`.
Everything here must be called from one thread, between steps (never between `schedule` and `update`).
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Sequence

from serving.core.block_manager import BlockManager
from serving.core.kv_manager import KVManager, cdiv
from serving.core.radix_cache import RadixCache
from serving.core.request import FinishReason, Request, RequestStatus
from serving.core.scheduler_output import (
    RequestRejected,
    RowResult,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepResult,
)


class Scheduler:
    """Owns requests and their KVManager; see the module docstring for the step protocol."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        enable_chunked_prefill: bool = True,
        kv_window: int | None = None,
        max_prefill_tokens_while_decoding: int = 0,
        prefill_share_while_waiting: float = 1.0,
    ):
        """Args:
        num_blocks: KV pages in the device pool, including the null page 0.
        block_size: tokens per page.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step.
        max_model_len: most tokens (prompt + outputs) per request.
        enable_prefix_caching: reuse KV of shared prefixes through a radix cache.
        policy: "fcfs" (arrival order) or "priority" (lower Request.priority first, then arrival).
        long_prefill_token_threshold: cap on one request's tokens per step (0: no cap).
        enable_chunked_prefill: when False a prompt is admitted only if it fits the budget whole.
        kv_window: sliding window of every layer (ModelConfig.kv_window): KV blocks outside it are given back.
        max_prefill_tokens_while_decoding: prompt tokens a step carries in all while it has decode rows (0: the
            whole budget): a step with a full prefill chunk stalls every decoding row for it (inter-token latency).
        prefill_share_while_waiting: the budget share of a running prompt's chunk while a waiting request could start.
        """
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        for name, value in (
            ("long_prefill_token_threshold", long_prefill_token_threshold),
            ("max_prefill_tokens_while_decoding", max_prefill_tokens_while_decoding),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            if value and not enable_chunked_prefill:  # a prompt over the cap could never start while rows decode
                raise ValueError(f"{name} needs enable_chunked_prefill")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        if not 0.0 < prefill_share_while_waiting <= 1.0:
            raise ValueError(f"prefill_share_while_waiting must be in (0, 1], got {prefill_share_while_waiting}")
        self.prefill_share_while_waiting = prefill_share_while_waiting
        self._prefill_left = max_num_batched_tokens  # prompt tokens this step may still take (schedule())
        # True when the last schedule() left waiting requests it could not start (no free slot, too few free blocks
        # or no budget) and none has finished or arrived since: the next schedule() would start none either, so
        # the engine may go on decoding on the device meanwhile (serving/engine/decode_loop.py).
        self.admission_blocked = False
        self.enable_chunked_prefill = enable_chunked_prefill
        self.kv = KVManager(num_blocks, block_size, enable_prefix_caching, window=kv_window)
        self.requests: dict[str, Request] = {}  # Unfinished requests.
        self.running: list[Request] = []
        self._waiting: collections.deque[Request] | list[Request] = [] if policy == "priority" else collections.deque()
        self._add_order: dict[str, int] = {}
        self._counter = itertools.count()
        self._needs_progress: set[str] = set()  # Resumed after preemption, no new token yet.
        self.num_preemptions = 0

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table row that covers max_model_len tokens."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def block_manager(self) -> BlockManager:
        """The KVManager's pool (read it; blocks change only through `kv`)."""
        return self.kv.block_manager

    @property
    def cache(self) -> RadixCache | None:
        """The KVManager's prefix cache, or None (read it; blocks change only through `kv`)."""
        return self.kv.cache

    @property
    def prefix_queried_tokens(self) -> int:
        return self.kv.prefix_queried_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.kv.prefix_hit_tokens

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            num_free_blocks=self.kv.num_free_blocks,
            num_used_blocks=self.kv.num_used_blocks,
            num_cached_blocks=self.kv.num_cached_blocks,
            num_preemptions=self.num_preemptions,
            prefix_queried_tokens=self.kv.prefix_queried_tokens,
            prefix_hit_tokens=self.kv.prefix_hit_tokens,
        )

    # ----------------------------------------------------------------------------------------------- requests

    def add_request(self, req: Request) -> None:
        """Queues a new request.

        Raises:
            ValueError: for a duplicate request_id.
            RequestRejected: when the request can never be served (empty prompt,
                prompt longer than max_model_len, more KV blocks than the pool has, or, without chunked
                prefill, a prompt over the token budget). The request is marked finished with reason 'error'.
        """
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        reason = self._rejection(req)
        if reason is not None:
            req.status, req.finish_reason, req.finish_message = RequestStatus.FINISHED, "error", reason
            raise RequestRejected(f"request {req.request_id!r} rejected: {reason}")
        req.status = RequestStatus.WAITING
        self.admission_blocked = False  # it may be the one to start (priority order)
        self.requests[req.request_id] = req
        self._add_order[req.request_id] = next(self._counter)
        self._push_waiting(req, front=False)

    def abort(self, request_id: str) -> Request | None:
        """Finishes a request with reason 'abort' in any state, releasing its blocks. None if unknown."""
        if request_id not in self.requests:
            return None
        return self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: FinishReason = "stop", message: str | None = None) -> Request:
        """Finishes a request (e.g. the engine matched a stop string): its computed full blocks go to the
        prefix cache, its references are dropped, and it leaves the scheduler."""
        req = self.requests.pop(request_id)
        self.admission_blocked = False  # its slot and blocks may start a waiting request
        if req.status is RequestStatus.RUNNING:
            self.kv.release(req)
            self.running.remove(req)
        else:
            self._waiting.remove(req)
        req.status, req.finish_reason, req.finish_message = RequestStatus.FINISHED, reason, message
        self._add_order.pop(request_id, None)
        self._needs_progress.discard(request_id)
        return req

    # ---------------------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plans one step; see the module docstring."""
        out = SchedulerOutput()
        scheduled: set[str] = set()
        self._schedule_running(out, scheduled, protect=True)
        if not out.scheduled and self.running:
            # Every running request is protected and waiting for blocks: only preempting one of them can unblock
            # the others.
            self._schedule_running(out, scheduled, protect=False)
        self._attach_drafts(out)
        if not out.preempted_ids:
            self._admit_waiting(out)
        self.admission_blocked = not out.preempted_ids and bool(self._waiting)
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[str], protect: bool) -> None:
        """Decode rows first, then unfinished prefills, each oldest first, while the budget lasts."""
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, self._age(r)))
        decodes_left = sum(r.num_tokens - r.num_computed_tokens == 1 for r in order)
        cap = self.max_prefill_tokens_while_decoding
        self._prefill_left = cap if cap and decodes_left else self.max_num_batched_tokens
        share = self._running_prefill_share()
        for req in order:
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                return
            decodes_left -= req.num_tokens - req.num_computed_tokens == 1
            if req.status is not RequestStatus.RUNNING:
                continue  # Preempted earlier in this loop.
            n = self._num_new_tokens(req, budget)
            n = min(n, share) if n > 1 else n  # a prompt's chunk: room for the requests waiting to start
            if n and self._allocate_or_preempt(req, n, scheduled, out, protect):
                # Drafts leave one token of budget for each later decode row.
                self._emit(req, n, out, num_draft=self._num_drafts(req, budget - decodes_left))
                scheduled.add(req.request_id)

    def _running_prefill_share(self) -> int:
        """Tokens a running prompt's chunk may take: its share of the budget while a waiting request could start."""
        could_admit = self._waiting and len(self.running) < self.max_num_seqs and not self.admission_blocked
        share = self.prefill_share_while_waiting if could_admit else 1.0
        return max(1, int(self.max_num_batched_tokens * share))

    def _attach_drafts(self, out: SchedulerOutput) -> None:
        """Takes blocks for the drafts of this step's decode rows once every running row has its own (so drafts
        never cause a preemption): as many drafts as fit, the budget of the others returned to admission."""
        for sr in out.scheduled:
            req, k = sr.request, sr.num_draft
            if not k:
                continue
            while k and not self.kv.can_allocate(req, 1 + k):
                k -= 1
            if k and not out.take(self.kv.append_provisional(req, k)):
                k = 0
            out.num_batched_tokens -= sr.num_draft - k
            sr.token_ids, sr.num_draft, sr.block_table = sr.token_ids[: 1 + k], k, list(req.block_ids)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        """Starts waiting requests at the head of the queue while slots, budget and blocks last."""
        while self._waiting and len(self.running) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                return
            req = self._waiting[0]
            self.kv.lookup_prefix(req)
            n = self._num_new_tokens(req, budget)
            # Without chunked prefill a prompt starts only whole; a resumed request may exceed the budget with
            # its outputs, so it is chunked regardless (else it could never run again).
            whole = n == req.num_tokens - req.num_computed_tokens
            chunk_ok = self.enable_chunked_prefill or req.num_preemptions > 0
            if (
                not n
                or not (whole or chunk_ok)
                or not self.kv.can_allocate(req, req.num_tokens - req.num_computed_tokens)
                or not out.take(self.kv.allocate(req, n))
            ):
                self.kv.release(req)  # Undo the prefix hit; retry next step.
                req.num_computed_tokens = 0
                return
            self._pop_waiting()
            self.kv.record_admission(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(req, n, out)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        left = req.num_tokens - req.num_computed_tokens
        if left > 1:  # a prefill row (a decode row's drafts are not in num_tokens)
            budget = min(budget, self._prefill_left)
        return min(left, budget, self.long_prefill_token_threshold or budget)

    def _num_drafts(self, req: Request, budget: int) -> int:
        """Draft tokens a decode row can verify this step: its drafts trimmed to the budget (after its own
        token), to max_model_len (the last draft's position must exist) and to max_tokens (a draft past it could
        never be emitted)."""
        if not req.spec_token_ids or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        cap = self.long_prefill_token_threshold or budget
        # A row emits at most remaining_tokens tokens: its own token's successor and remaining - 1 drafts.
        return max(0, min(len(req.spec_token_ids), min(budget, cap) - 1, req.remaining_tokens(self.max_model_len) - 1))

    def _emit(self, req: Request, n: int, out: SchedulerOutput, num_draft: int = 0) -> None:
        start = req.num_computed_tokens
        if req.num_tokens - start > 1:
            self._prefill_left -= n
        tokens = req.all_token_ids[start : start + n] + req.spec_token_ids[:num_draft]
        out.scheduled.append(
            ScheduledRequest(req, tokens, start, list(req.block_ids), start + n == req.num_tokens, num_draft)
        )
        out.num_batched_tokens += len(tokens)

    # ------------------------------------------------------------------------------------------- preemption

    def _allocate_or_preempt(
        self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput, protect: bool
    ) -> bool:
        """Gets blocks for n more tokens of a running request, preempting the youngest unscheduled running
        request (possibly req itself) while short. With `protect`, requests resumed after a preemption that have
        not sampled since are never victims; a protected req with no victim waits, keeping its blocks.

        Returns False when req was preempted or must wait."""
        while not out.take(self.kv.allocate(req, n)):
            candidates = [
                r
                for r in self.running
                if r.request_id not in scheduled and not (protect and r.request_id in self._needs_progress)
            ]
            victim = max(candidates, key=self._age, default=None)
            if victim is None:
                return False
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: keep outputs, drop KV (cached where full) and drafts, back to the waiting
        head."""
        self.kv.release(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._needs_progress.add(req.request_id)
        self._push_waiting(req, front=True)

    # ------------------------------------------------------------------------------------------------ update

    def reserve_lookahead(self, requests: Sequence[Request], num_tokens: int, cow_pairs: list[tuple[int, int]]) -> bool:
        """Extends running requests' blocks by `num_tokens` positions past this step's tokens (all known tokens),
        for a multi-step decode loop (several tokens per row before the next `schedule`).

        Call between `schedule` and `update`; read the blocks from `request.block_ids` (the step's block_table
        predates them) and report the KV written through `update(..., computed=...)`. Never preempts; the prefix
        cache may be evicted. Blocks taken stay with their request either way (used by later steps or freed
        with it).

        Args:
            requests: running requests, typically this step's decode rows.
            num_tokens: extra positions each needs.
            cow_pairs: receives (src, dst) page copies the runner must make first.

        Returns:
            False if some request could not be covered without preempting: run a single step instead.
        """
        for req in requests:
            if req.status is not RequestStatus.RUNNING:
                raise ValueError(f"reserve_lookahead: {req.request_id!r} is not running")
            alloc = self.kv.allocate(req, req.num_tokens - req.num_computed_tokens + num_tokens)
            cow_pairs.extend(alloc.cow_pairs)
            if not alloc:
                return False
        return True

    def update(self, result: StepResult) -> list[Request]:
        """Applies a computed step.

        `result` holds per scheduled row: the tokens sampled (every row with `sample` set needs at least one; a
        row with drafts gets its accepted drafts, a prefix of them, and one bonus / correction token; several
        tokens for a row without drafts come from a k-step loop, see num_computed), their logprob entries
        (appended to output_logprobs), and num_computed: positions whose KV the step wrote from start_pos on when
        more than len(token_ids) (a k-step loop, into blocks from `reserve_lookahead`; not for rows with drafts,
        whose valid KV is 1 + accepted drafts). Tokens after one that stops the request are dropped, and so is
        KV past it. Rows of requests finished or aborted since `schedule` are skipped; each finished row's
        finish_reason is set.

        Returns:
            Requests finished by a token-level stop condition this step.
        """
        live: list[tuple[ScheduledRequest, RowResult]] = []
        for sr, row in result:  # Skips requests finished or aborted since schedule(): their tokens are dropped.
            if self.requests.get(sr.request_id) is sr.request and sr.request.status is RequestStatus.RUNNING:
                live.append((sr, row))
            else:
                row.token_ids, row.logprobs = [], None
        for sr, row in live:  # Validate everything before changing anything.
            sr.check_tokens(row.token_ids, row.num_computed)
        finished = []
        for sr, row in live:
            req, tokens = sr.request, row.token_ids
            # Valid KV from start_pos on: a draft row's own token and its accepted drafts (the rest is garbage).
            n_valid = len(tokens) if sr.num_draft else (row.num_computed or len(sr.token_ids))
            keep, reason = req.first_stop(tokens, self.max_model_len)
            req.extend_output(tokens[:keep], row.logprobs[:keep] if row.logprobs else None)
            del tokens[keep:]  # what the request took: the step's result streams exactly these
            if row.logprobs:
                del row.logprobs[keep:]
            # Positions past the kept tokens hold KV of tokens dropped after a stop: not part of the request.
            req.num_computed_tokens = min(sr.start_pos + n_valid, req.num_tokens)
            req.spec_token_ids = []
            if tokens:
                self._needs_progress.discard(req.request_id)
            if reason is not None:
                row.finish_reason = reason
                finished.append(self.finish(req.request_id, reason))
                continue
            if sr.num_draft:
                self.kv.rollback(req, sr.num_draft + 1 - len(tokens))
            if sr.start_pos < req.num_prompt_tokens:
                self.kv.cache_computed(req)  # Share prompt blocks with concurrent requests as soon as computed.
        return finished

    # ------------------------------------------------------------------------------------------------ helpers

    def _rejection(self, req: Request) -> str | None:
        prompt_len = req.num_prompt_tokens
        if prompt_len == 0:
            return "empty prompt"
        if req.num_tokens > self.max_model_len:
            return f"prompt of {req.num_tokens} tokens is longer than max_model_len={self.max_model_len}"
        if not self.enable_chunked_prefill and req.num_tokens > self.max_num_batched_tokens:
            return (
                f"prompt of {req.num_tokens} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} and chunked prefill is disabled"
            )
        max_positions = min(prompt_len + req.sampling_params.max_tokens - 1, self.max_model_len)
        needed = self.kv.blocks_for(max(max_positions, req.num_tokens))
        if needed > self.kv.num_usable_blocks:
            return (
                f"needs up to {needed} KV blocks ({max_positions} positions); the pool has {self.kv.num_usable_blocks}"
            )
        return None

    def _age(self, req: Request) -> tuple:
        """Sort key: smaller is older (served first, preempted last)."""
        order = self._add_order[req.request_id]
        return (req.priority, req.arrival_time, order) if self.policy == "priority" else (order,)

    def _push_waiting(self, req: Request, front: bool) -> None:
        if self.policy == "priority":
            bisect.insort(self._waiting, req, key=self._age)
        elif front:
            self._waiting.appendleft(req)
        else:
            self._waiting.append(req)

    def _pop_waiting(self) -> Request:
        return self._waiting.pop(0) if self.policy == "priority" else self._waiting.popleft()

    def check_invariants(self) -> None:
        """Asserts that request states, block references, cache locks and provisional positions all agree."""
        for req in self.running:
            assert req.status is RequestStatus.RUNNING, f"{req.request_id} in running as {req.status}"
            assert req.num_computed_tokens <= req.num_tokens, req.request_id
        for req in self._waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req.request_id
            assert not req.block_ids and req.num_computed_tokens == 0, f"waiting {req.request_id} holds blocks"
        assert len(self.running) <= self.max_num_seqs
        assert len(self.running) + len(self._waiting) == len(self.requests)
        assert all(self.requests.get(r.request_id) is r for r in itertools.chain(self.running, self._waiting))
        self.kv.check_invariants(self.running)
