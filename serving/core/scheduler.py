"""Iteration-level scheduler under a token budget (pure Python, no JAX).

One step of the engine:

    out = scheduler.schedule()                  # which tokens of which requests to compute, and where
    ...runner copies out.cow_pairs pages, computes out.scheduled, samples rows with .sample...
    done = scheduler.update(out, {request_id: [token, ...]})

Between steps the engine may call add_request (raises RequestRejected for a request that can never run),
abort / finish (any state; blocks released), fork (parallel sampling), stats(); within a step,
reserve_lookahead before a multi-step decode loop (then update(..., computed=...)).

There is one path for every kind of work, as in vLLM v1: a request needs `num_tokens - num_computed_tokens`
more positions computed. A fresh prompt needs all of them (minus prefix-cache hits), a decode row needs 1 (the
token sampled last step), a request resumed after preemption needs its prompt and outputs again. Each step:

1. Running requests, decode rows (one token left) first, then unfinished prefills, each group oldest first.
   Each takes min(remaining, budget left, long_prefill_token_threshold) tokens. When blocks run out the youngest
   unscheduled running request is preempted by recompute (its computed full blocks go to the prefix cache, its
   references are dropped, it returns to the front of the waiting queue with num_computed_tokens = 0).
   No livelock: a request resumed after preemption is protected until it samples a new token. It is never a
   victim; when it is short of blocks itself and only protected requests are left to preempt, it waits (keeping
   its blocks) while unprotected requests run or preempt themselves. Only when a whole step would schedule
   nothing (every running request protected and blocked) is protection dropped for that step. So each
   preemption of a request is followed by a new token of it, and every step makes progress.
2. If nothing was preempted, waiting requests in FCFS order (or by priority, then arrival), while slots, budget
   and blocks last. Admission looks up the prefix cache for `all_token_ids[:-1]`: at least the last token is
   always computed so that its logits exist. A request starts only when blocks for all its known tokens are free
   or evictable (it then allocates chunk by chunk), so half-computed prefills do not fill the pool and preempt
   each other. A request that cannot start stays at the head of the queue
   (admission never preempts, so priority orders admission and victims but does not evict running requests).
   Requests that could never fit (prompt over max_model_len, more blocks than the pool) are refused by
   `add_request` instead of waiting forever.

Each request is one sequence: SamplingParams.n is the engine's to fan out (separate requests sharing the prompt
through the prefix cache, or `fork` after the prompt is computed).

Block tables:

    positions  0 .. start-1 (KV written)     start .. start+len-1 (this step)
    blocks     [ b0 | b1 | ... | b(k-1) ]    block_table = all blocks covering positions < start + len

Writes into a block shared with someone else (refcount > 1) first copy it (copy-on-write; only requests made
by `fork` share a block they write). Block 0 is the null page (see block_manager.py) and never appears.

Stop conditions at the token level (EOS unless ignore_eos, stop_token_ids, both only once min_tokens outputs
exist; max_tokens; max_model_len) are checked in `update`. Stop strings are the engine's: it calls `finish`.
Everything here must be called from one thread, between steps (never between `schedule` and `update`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from serving.core.block_manager import BlockManager
from serving.core.radix_cache import RadixCache, RadixNode
from serving.core.request import FinishReason, Request, RequestStatus


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
    """

    request: Request
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled: per-request work, decode rows first.
        cow_pairs: (src, dst) pages the runner copies before the step's KV writes.
        preempted_ids: requests preempted this step (they lost their KV and wait to be recomputed).
        num_batched_tokens: sum of len(token_ids) over scheduled (<= max_num_batched_tokens).
    """

    scheduled: list[ScheduledRequest] = dataclasses.field(default_factory=list)
    cow_pairs: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted_ids: list[str] = dataclasses.field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Owns requests, the block pool and the prefix cache; see the module docstring for the step protocol."""

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
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}")
        if long_prefill_token_threshold and not enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        self.block_manager = BlockManager(num_blocks)
        self.cache = RadixCache(self.block_manager, block_size) if enable_prefix_caching else None
        self.requests: dict[str, Request] = {}  # Unfinished requests.
        self.running: list[Request] = []
        self._waiting: collections.deque[Request] | list[Request] = [] if policy == "priority" else collections.deque()
        self._add_order: dict[str, int] = {}
        self._counter = itertools.count()
        self._lock_node: dict[str, RadixNode] = {}  # Deepest cache node a request uses, locked.
        self._num_tree_blocks: dict[str, int] = {}  # Leading blocks of a request that are in the cache.
        self._needs_progress: set[str] = set()  # Resumed after preemption, no new token yet.
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table row that covers max_model_len tokens."""
        return _cdiv(self.max_model_len, self.block_size)

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
            num_free_blocks=self.block_manager.num_free,
            num_used_blocks=self.block_manager.num_used,
            num_cached_blocks=self.cache.num_cached_blocks if self.cache else 0,
            num_preemptions=self.num_preemptions,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )

    # ----------------------------------------------------------------------------------------------- requests

    def add_request(self, req: Request) -> None:
        """Queues a new request.

        Raises:
            ValueError: for a duplicate request_id.
            RequestRejected: when the request can never be served (invalid sampling params, empty prompt,
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
        if req.status is RequestStatus.RUNNING:
            self._release(req)
            self.running.remove(req)
        else:
            self._waiting.remove(req)
        req.status, req.finish_reason, req.finish_message = RequestStatus.FINISHED, reason, message
        self._add_order.pop(request_id, None)
        self._needs_progress.discard(request_id)
        return req

    def fork(self, parent_id: str, child: Request) -> None:
        """Starts `child` (same prompt, no outputs) sharing the parent's prompt KV, for parallel sampling.

        The parent must be running with its prompt computed. The child shares the parent's prompt blocks and
        recomputes only the last prompt token, so its next step samples its own first token; the block holding
        that position is shared, so the write copies it (a copy-on-write pair in that step's output).

        Raises:
            ValueError: when the parent is not running past its prompt, the prompts differ, or the running set
                is full.
        """
        parent = self.requests.get(parent_id)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"fork: parent {parent_id!r} is not running")
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            raise ValueError(f"fork: parent {parent_id!r} has not finished its prompt")
        if tuple(child.prompt_token_ids) != parent.prompt_token_ids or child.output_token_ids:
            raise ValueError("fork: the child must have the parent's prompt and no outputs")
        if child.request_id in self.requests or len(self.running) >= self.max_num_seqs:
            raise ValueError(f"fork: duplicate id {child.request_id!r} or running set full")
        reason = self._rejection(child)
        if reason is not None:
            raise RequestRejected(f"request {child.request_id!r} rejected: {reason}")
        child.block_ids = parent.block_ids[: _cdiv(child.num_prompt_tokens, self.block_size)]
        self.block_manager.incref(child.block_ids)
        child.num_computed_tokens = child.num_prompt_tokens - 1
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self._add_order[child.request_id] = next(self._counter)
        self.running.append(child)

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
        if not out.preempted_ids:
            self._admit_waiting(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[str], protect: bool) -> None:
        """Decode rows first, then unfinished prefills, each oldest first, while the budget lasts."""
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, self._age(r)))
        for req in order:
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                return
            if req.status is not RequestStatus.RUNNING:
                continue  # Preempted earlier in this loop.
            n = self._num_new_tokens(req, budget)
            if self._allocate_or_preempt(req, n, scheduled, out, protect):
                self._emit(req, n, out)
                scheduled.add(req.request_id)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        """Starts waiting requests at the head of the queue while slots, budget and blocks last."""
        while self._waiting and len(self.running) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                return
            req = self._waiting[0]
            node = self._lookup_prefix(req)
            n = self._num_new_tokens(req, budget)
            # Without chunked prefill a prompt starts only whole; a resumed request may exceed the budget with
            # its outputs, so it is chunked regardless (else it could never run again).
            whole = n == req.num_tokens - req.num_computed_tokens
            chunk_ok = self.enable_chunked_prefill or req.num_preemptions > 0
            if not (whole or chunk_ok) or not self._fits_whole(req) or not self._allocate(req, n, out.cow_pairs):
                self._drop_blocks(req, node)  # Undo the prefix hit; retry next step.
                return
            self._pop_waiting()
            if node is not None:
                self._lock_node[req.request_id] = node
                self._num_tree_blocks[req.request_id] = req.num_computed_tokens // self.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.prefix_queried_tokens += req.num_prompt_tokens
                self.prefix_hit_tokens += req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(req, n, out)

    def _fits_whole(self, req: Request) -> bool:
        """Whether blocks for all of req's known tokens are free or evictable now. Checked at admission so that
        chunked prefills (resumed requests especially) start only when they can finish, rather than filling the
        pool with half-computed requests that then preempt each other."""
        need = _cdiv(req.num_tokens, self.block_size) - len(req.block_ids)
        evictable = self.cache.num_evictable_blocks if self.cache else 0
        return need <= self.block_manager.num_free + evictable

    def _lookup_prefix(self, req: Request) -> RadixNode | None:
        """Takes the cached prefix of all but the last token: references its blocks and locks its node."""
        if self.cache is None:
            return None
        match = self.cache.match_prefix(req.all_token_ids[: req.num_tokens - 1], req.cache_namespace)
        self.cache.lock(match.node)
        self.block_manager.incref(match.block_ids)
        req.block_ids = list(match.block_ids)
        req.num_computed_tokens = match.num_tokens
        return match.node

    def _drop_blocks(self, req: Request, node: RadixNode | None) -> None:
        self.block_manager.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        if node is not None:
            self.cache.unlock(node)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        return n

    def _emit(self, req: Request, n: int, out: SchedulerOutput) -> None:
        start = req.num_computed_tokens
        out.scheduled.append(
            ScheduledRequest(
                req,
                req.all_token_ids[start : start + n],
                start,
                list(req.block_ids),
                sample=start + n == req.num_tokens,
            )
        )
        out.num_batched_tokens += n

    # ------------------------------------------------------------------------------------ blocks, preemption

    def _allocate_or_preempt(
        self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput, protect: bool
    ) -> bool:
        """Gets blocks for n more tokens of a running request, preempting the youngest unscheduled running
        request (possibly req itself) while short. With `protect`, requests resumed after a preemption that have
        not sampled since are never victims; a protected req with no victim waits, keeping its blocks.

        Returns False when req was preempted or must wait."""
        while not self._allocate(req, n, out.cow_pairs):
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

    def _allocate(self, req: Request, n: int, cow_pairs: list[tuple[int, int]]) -> bool:
        """Makes req's blocks cover positions < num_computed_tokens + n and private where written.

        Evicts from the prefix cache when the free queue is short. Returns False, taking no blocks, when even the
        evictable cache cannot cover the shortfall (or, rarely, when evicted blocks turned out to be shared)."""
        bm, bs = self.block_manager, self.block_size
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if n == 1 and start // bs < len(req.block_ids) and bm.refcount(req.block_ids[start // bs]) == 1:
            return True  # Decode fast path: the token goes into a private block already held.
        num_new = max(0, _cdiv(end, bs) - len(req.block_ids))
        written = range(start // bs, min(len(req.block_ids), _cdiv(end, bs)))
        shared = [i for i in written if bm.refcount(req.block_ids[i]) > 1]
        need = num_new + len(shared)
        if need > bm.num_free:
            evictable = self.cache.num_evictable_blocks if self.cache else 0
            if need > bm.num_free + evictable:
                return False
            self.cache.evict(need - bm.num_free)
            if need > bm.num_free:
                return False
        for i in shared:
            cow = bm.copy_on_write(req.block_ids[i])
            req.block_ids[i] = cow.block_id
            cow_pairs.append(cow.pair)
        req.block_ids.extend(bm.allocate(num_new))
        return True

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: keep outputs, drop KV (cached where full), back to the waiting head."""
        self._release(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._needs_progress.add(req.request_id)
        self._push_waiting(req, front=True)

    def _release(self, req: Request) -> None:
        """Caches req's computed full blocks, unlocks its cache node and drops its block references."""
        if self.cache is not None:
            self._cache_blocks(req)
            node = self._lock_node.pop(req.request_id, None)
            if node is not None:
                self.cache.unlock(node)
            self._num_tree_blocks.pop(req.request_id, None)
        self.block_manager.free(req.block_ids)
        req.block_ids = []

    def _cache_blocks(self, req: Request) -> None:
        """Inserts req's computed full blocks into the cache; where the cache already held a block for the
        same tokens, req switches to it and frees its duplicate. Moves req's lock to the new deepest node."""
        k = req.num_computed_tokens // self.block_size
        if k <= self._num_tree_blocks.get(req.request_id, 0):
            return
        result = self.cache.insert(req.all_token_ids[: k * self.block_size], req.block_ids[:k], req.cache_namespace)
        for i, cached in enumerate(result.block_ids):
            if req.block_ids[i] != cached:
                self.block_manager.incref([cached])
                self.block_manager.free([req.block_ids[i]])
                req.block_ids[i] = cached
        self.cache.lock(result.node)
        old = self._lock_node.get(req.request_id)
        if old is not None:
            self.cache.unlock(old)
        self._lock_node[req.request_id] = result.node
        self._num_tree_blocks[req.request_id] = k

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
            if not self._allocate(req, req.num_tokens - req.num_computed_tokens + num_tokens, cow_pairs):
                return False
        return True

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, Sequence[int]],
        logprobs: Mapping[str, Sequence[Any]] | None = None,
        computed: Mapping[str, int] | None = None,
    ) -> list[Request]:
        """Applies a computed step.

        Args:
            output: what `schedule` returned for this step.
            sampled: request_id -> tokens sampled for it (one normally, several with speculative decoding); every
                row with `sample` set needs at least one. Tokens after one that stops the request are dropped.
            logprobs: optional request_id -> one entry per sampled token, appended to output_logprobs.
            computed: optional request_id -> positions whose KV this step wrote from start_pos on, when more
                than len(token_ids): a k-step decode loop writes the scheduled token and the first k - 1 sampled
                ones (into blocks from `reserve_lookahead`). KV past a stop token is discarded.

        Returns:
            Requests finished by a token-level stop condition this step.
        """
        live = [
            sr
            for sr in output.scheduled  # Skips requests finished or aborted since schedule().
            if self.requests.get(sr.request_id) is sr.request and sr.request.status is RequestStatus.RUNNING
        ]
        for sr in live:  # Validate everything before changing anything.
            self._check_row(sr, sampled.get(sr.request_id, ()), (computed or {}).get(sr.request_id))
        finished = []
        for sr in live:
            req = sr.request
            tokens = sampled.get(req.request_id, ())
            n_computed = (computed or {}).get(req.request_id, len(sr.token_ids))
            entries = logprobs.get(req.request_id) if logprobs else None
            reason = None
            for j, token in enumerate(tokens):
                req.append_output(token, entries[j] if entries else None)
                reason = self._stop_reason(req, token)
                if reason is not None:
                    break
            # Positions past the kept tokens hold KV of tokens dropped after a stop: not part of the request.
            req.num_computed_tokens = min(sr.start_pos + n_computed, req.num_tokens)
            if tokens:
                self._needs_progress.discard(req.request_id)
            if reason is not None:
                finished.append(self.finish(req.request_id, reason))
            elif self.cache is not None and sr.start_pos < req.num_prompt_tokens:
                self._cache_blocks(req)  # Share prompt blocks with concurrent requests as soon as computed.
        return finished

    @staticmethod
    def _check_row(sr: ScheduledRequest, tokens: Sequence[int], n_computed: int | None) -> None:
        rid = sr.request_id
        if sr.sample and not tokens:
            raise ValueError(f"request {rid!r} was sampled this step but got no token")
        if tokens and not sr.sample:
            raise ValueError(f"request {rid!r} got tokens for a non-final prefill chunk")
        n = len(sr.token_ids)
        if n_computed is not None and not n <= n_computed <= n + max(len(tokens) - 1, 0):
            raise ValueError(
                f"request {rid!r}: computed={n_computed} for {n} scheduled and {len(tokens)} sampled tokens"
            )

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if (token in params.stop_token_ids) or (not params.ignore_eos and token in req.eos_token_ids):
                return "stop"
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------------------------------------ helpers

    def _rejection(self, req: Request) -> str | None:
        try:
            req.sampling_params.validate()
        except ValueError as e:
            return f"invalid sampling params: {e}"
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
        needed = _cdiv(max(max_positions, req.num_tokens), self.block_size)
        if needed > self.block_manager.num_usable_blocks:
            return (
                f"needs up to {needed} KV blocks ({max_positions} positions) but the pool has "
                f"{self.block_manager.num_usable_blocks}"
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
        """Asserts that block references, cache locks and request states all agree."""
        self.block_manager.check_invariants()
        expected = collections.Counter()
        for req in self.running:
            assert req.status is RequestStatus.RUNNING, f"{req.request_id} in running as {req.status}"
            assert _cdiv(req.num_computed_tokens, self.block_size) <= len(req.block_ids), req.request_id
            assert req.num_computed_tokens <= req.num_tokens, req.request_id
            expected.update(req.block_ids)
        for req in self._waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req.request_id
            assert not req.block_ids and req.num_computed_tokens == 0, f"waiting {req.request_id} holds blocks"
        assert len(self.running) <= self.max_num_seqs
        assert len(self.running) + len(self._waiting) == len(self.requests)
        assert all(self.requests.get(r.request_id) is r for r in itertools.chain(self.running, self._waiting))
        if self.cache is not None:
            self.cache.check_invariants()
            expected.update(self.cache.cached_block_ids())
            locks = sum(not node.is_root for node in self._lock_node.values())
            assert locks == self.cache.num_locks(), f"{locks} request locks, the cache counts {self.cache.num_locks()}"
        for b in range(1, self.block_manager.num_blocks):
            assert self.block_manager.refcount(b) == expected[b], (
                f"block {b}: refcount {self.block_manager.refcount(b)}, holders {expected[b]}"
            )
