"""Multi-step decode loops, pipelined so the device never waits for the host.

When every scheduled row is a plain decode row and no request needs the host between tokens (nothing waiting
for a free slot, no stop strings, penalties, logprobs or min_tokens bans), the engine runs `decode_steps`
decode iterations in one jitted loop and applies them to the scheduler at once.

With overlap on, the next loop for the same rows is dispatched *before* the host reads the current one: its
input tokens are the current loop's last tokens, still on the device (runner.decode_loop's `chain`). So while
the GPU runs loop N+1, the host copies out loop N's tokens, applies them to the scheduler (stop conditions,
block caching), detokenises and streams them; the results of N+1 are applied one engine step later.

    host:    launch N | launch N+1, fetch+apply N | launch N+2, fetch+apply N+1 | ...
    device:  [ loop N ][ loop N+1               ][ loop N+2                   ]

Why this is exact: loop N+1 computes exactly what it would compute had it been launched after N was applied
(same tokens, positions, blocks, sampling steps). A row that stops inside loop N (EOS, a stop id) makes N+1's
work for it junk: its tokens are dropped (the request is no longer running when N+1 is applied) and its KV
writes land past the request's last computed position, in blocks that are partial (never prefix-cached) and
that later owners overwrite after N+1 has run (the device executes in dispatch order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.sampling import SamplingTensors
from serving.core.request import Request, RequestStatus
from serving.core.scheduler_output import ScheduledRequest, SchedulerOutput
from serving.engine.runner import LoopHandle, RowInput, _chain_tokens


@dataclasses.dataclass
class InFlight:
    """A dispatched loop: its rows (request, first position), per-row token counts and the device handle."""

    rows: list[tuple[Request, int]]
    limits: list[int]
    handle: LoopHandle
    out: SchedulerOutput | None = None  # the scheduler's plan for a first loop; chained loops build theirs


class DecodeLoops:
    """Decides when a decode loop runs, launches it (or chains the next one) and collects its tokens."""

    def __init__(self, engine, sampling_tensors):
        self._engine = engine  # reads its scheduler, runner, config and max_model_len (tests swap the scheduler)
        self._sampling_tensors = sampling_tensors  # (requests, tokens ahead) -> SamplingTensors
        self.num_loops = 0
        self.num_chained = 0

    scheduler = property(lambda self: self._engine.scheduler)
    runner = property(lambda self: self._engine.runner)
    k = property(lambda self: self._engine.config.decode_steps)
    max_num_seqs = property(lambda self: self._engine.config.max_num_seqs)
    max_model_len = property(lambda self: self._engine.max_model_len)

    def _room(self) -> bool:
        """Loops run only when no waiting request could be admitted (starting one needs the host): none waits, or
        the last schedule could start none of them (every slot taken, or too few free blocks: the KV-bound regime
        of a long queue) and nothing has finished since, so none could start before a running request ends."""
        blocked = self.scheduler.admission_blocked or self.scheduler.num_running >= self.max_num_seqs
        return self.k > 1 and (not self.scheduler.num_waiting or blocked)

    def _row_limit(self, req: Request, ahead: int) -> int | None:
        """Tokens a loop starting `ahead` tokens past the request's state may compute; None: host needed."""
        p = req.sampling_params
        if p.stop or has_penalties(p) or p.logprobs is not None or req.num_output_tokens + ahead < p.min_tokens:
            return None
        if p.constraint is not None or p.logit_bias:  # a grammar's mask comes from the host; the bias is in _sample
            return None
        return min(self.k, p.max_tokens - req.num_output_tokens - ahead, self.max_model_len - req.num_tokens - ahead)

    def _reserve(self, reqs: Sequence[Request], counts: Sequence[int]) -> bool:
        cow: list[tuple[int, int]] = []
        ok = all(self.scheduler.reserve_lookahead([r], n - 1, cow) for r, n in zip(reqs, counts))
        self.runner.copy_blocks(cow)
        return ok

    def limits(self, out: SchedulerOutput) -> list[int] | None:
        """Per-row token counts for a loop over this step's rows (blocks reserved), or None for a normal step.

        The loop always runs `decode_steps` iterations (one compiled length per decode bucket, so nothing compiles
        while serving); a row closer than that to max_tokens or max_model_len stops writing KV after its own limit.
        The loop is used only when some row can take all of them.
        """
        if not self._room() or len(out.scheduled) > self.runner.decode_buckets[-1]:
            return None
        limits = []
        for sr in out.scheduled:
            n = self._row_limit(sr.request, 0) if len(sr.token_ids) == 1 and sr.sample else None
            if n is None:
                return None
            limits.append(n)
        if max(limits) < self.k or not self._reserve([sr.request for sr in out.scheduled], limits):
            return None
        return limits

    def launch(self, out: SchedulerOutput, limits: list[int]) -> InFlight:
        reqs = [sr.request for sr in out.scheduled]
        rows = [RowInput(sr.token_ids, sr.start_pos, list(sr.request.block_ids)) for sr in out.scheduled]
        handle = self._dispatch(rows, reqs, limits, 0, None)
        return InFlight([(sr.request, sr.start_pos) for sr in out.scheduled], limits, handle, out)

    def chain(self, cur: InFlight) -> InFlight | None:
        """The next loop for `cur`'s rows, dispatched before `cur` is read; None when the host is needed first."""
        if not self._room():
            return None
        reqs, starts, counts, index = [], [], [], []
        for i, ((req, start), n_cur) in enumerate(zip(cur.rows, cur.limits)):
            if req.status is not RequestStatus.RUNNING or self.scheduler.requests.get(req.request_id) is not req:
                continue  # aborted or finished since: nothing to chain
            n = self._row_limit(req, n_cur)
            if n is None:
                return None
            if n > 0:
                reqs.append(req)
                starts.append(start + n_cur)
                counts.append(n)
                index.append(i)
        if not reqs or max(counts) < self.k:
            return None
        ahead = [cur.limits[i] + n for i, n in zip(index, counts)]
        if not self._reserve(reqs, ahead):
            return None
        rows = [RowInput([0], s, list(r.block_ids)) for r, s in zip(reqs, starts)]
        handle = self._dispatch(rows, reqs, counts, [cur.limits[i] for i in index], (cur.handle, index))
        self.num_chained += 1
        return InFlight(list(zip(reqs, starts)), counts, handle)

    def warm_chain(self) -> None:
        """Compiles a chained loop's token gather (runner._chain_tokens) for every (previous, next) row bucket: a
        chained loop keeps a subset of the previous loop's rows. The runner's warm-up left them to first use."""
        buckets, mesh = self.runner.decode_buckets, self.runner.mesh
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None))  # as loops return tokens
        for prev in buckets:
            prev_tokens = jax.device_put(jnp.zeros((self.k, prev), jnp.int32), sharding)
            for s in (b for b in buckets if b <= prev):
                idx = jnp.asarray(np.zeros(s, np.int32))
                jax.block_until_ready(_chain_tokens(prev_tokens, idx, idx, np.zeros(s, np.int32)))

    def _dispatch(self, rows, reqs, limits, ahead, chain) -> LoopHandle:
        banned = np.full((self.k, len(reqs), 1), -1, np.int32)
        st: SamplingTensors = self._sampling_tensors(reqs, ahead)
        self.num_loops += 1
        handle = self.runner.decode_loop(rows, self.k, st, banned, np.asarray(limits, np.int32), chain=chain)
        # Queue the copy of this loop's results now, behind the loop itself: fetched only after the next loop was
        # dispatched, the copy ran after that loop too on the H200 (a profile at batch 64 / 256: 11.6 / 38 ms of idle
        # GPU between each loop's device-to-host copy and the next inputs), so the host applied with the GPU idle.
        handle.tokens.copy_to_host_async()
        handle.logprobs.copy_to_host_async()
        return handle

    def collect(self, cur: InFlight) -> tuple[SchedulerOutput, dict[str, list[int]], dict[str, int]]:
        """Waits for `cur` and returns (the step's plan, sampled tokens, KV positions computed) for update()."""
        tokens, _ = cur.handle.fetch()
        out = cur.out
        if out is None:  # a chained loop: its rows, as the scheduler would have planned them after the last loop
            live = [(r, s) for r, s in cur.rows if self.scheduler.requests.get(r.request_id) is r]
            out = SchedulerOutput(
                scheduled=[ScheduledRequest(r, r.all_token_ids[-1:], s, list(r.block_ids), True) for r, s in live],
                num_batched_tokens=len(live),
            )
        by_id = {r.request_id: i for i, (r, _) in enumerate(cur.rows)}
        columns = np.asarray(tokens).T.tolist()  # [rows][k] Python ints in one call, not one int() a token
        sampled, computed = {}, {}
        for sr in out.scheduled:
            i = by_id[sr.request_id]
            sampled[sr.request_id] = columns[i][: cur.limits[i]]
            computed[sr.request_id] = cur.limits[i]
        return out, sampled, computed


def has_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
