"""Decode loops on the device, pipelined so the device never waits for the host (async scheduling).

When every scheduled row is a plain decode row and no request needs the host between tokens (nothing waiting
for a free slot, no penalties, logprobs, min_tokens bans, grammar or logit bias; stop strings only in one-step
loops), the engine runs `decode_steps` decode iterations (by default 1 on a CPU host, 8 on an accelerator) in one jitted call
and applies them to the scheduler at once.

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

from model.sampling import SamplingTensors, pad_sampling
from serving.core.request import Request, RequestStatus
from serving.core.scheduler_output import RowResult, ScheduledRequest, SchedulerOutput, StepResult
from serving.engine.runner import LoopHandle, LoopInputs, RowInput, chain_tokens
from serving.engine.sampler import has_penalties, sampling_tensors


@dataclasses.dataclass
class InFlight:
    """A dispatched loop: its rows (request, first position), per-row token counts and the device handle."""

    rows: list[tuple[Request, int]]
    limits: list[int]
    handle: LoopHandle
    out: SchedulerOutput | None = None  # the scheduler's plan for a first loop; chained loops build theirs


@dataclasses.dataclass
class _Batch:
    """The loop in flight's rows as packed for the device: a persistent batch that the next chained loop over the
    same rows patches (positions and sampling steps advance by the tokens computed, a row's table takes the blocks
    it gained) instead of packing every row again."""

    handle: LoopHandle
    inputs: LoopInputs
    st: SamplingTensors  # padded to the decode bucket
    num_blocks: list[int]  # table entries written per row

    def next(self, reqs: Sequence[Request], limits: np.ndarray) -> tuple[LoopInputs, SamplingTensors] | None:
        """The inputs of the chained loop after this one over the same rows (the arrays are new: the dispatched
        ones may still be read by the device); None when a table outgrew its width bucket."""
        inp, n = self.inputs, self.inputs.num_rows
        ahead = np.zeros(inp.positions.shape[0], np.int32)
        ahead[:n] = limits
        tables = inp.tables
        grown = [i for i, r in enumerate(reqs) if len(r.block_ids) != self.num_blocks[i]]
        if any(len(reqs[i].block_ids) > tables.shape[1] for i in grown):
            return None
        if grown:
            tables = tables.copy()
            for i in grown:
                tables[i, : len(reqs[i].block_ids)] = reqs[i].block_ids
        return LoopInputs(inp.tokens, inp.positions + ahead, tables, n), dataclasses.replace(
            self.st, step=self.st.step + ahead
        )


class DecodeLoops:
    """Decides when a decode loop runs, launches it (or chains the next one) and collects its tokens.

    Args:
      scheduler / runner: the engine's (assignable: the engine keeps them current).
      decode_steps: iterations per loop (k).
      max_num_seqs: the scheduler's row limit (a full batch admits no one: loops may run with requests waiting).
      max_model_len: the context length (a row's budget, Request.remaining_tokens).
    """

    def __init__(self, scheduler, runner, decode_steps: int, max_num_seqs: int, max_model_len: int):
        self.scheduler, self.runner = scheduler, runner
        self.k, self.max_num_seqs, self.max_model_len = decode_steps, max_num_seqs, max_model_len
        self.num_loops = 0
        self.num_chained = 0
        self._batch: _Batch | None = None  # the loop in flight, packed
        self._cow = False  # the last reservation copied pages

    def _room(self) -> bool:
        """Loops run only when no waiting request could be admitted (starting one needs the host): none waits, or
        the last schedule could start none of them (every slot taken, or too few free blocks: the KV-bound regime
        of a long queue) and nothing has finished since, so none could start before a running request ends."""
        blocked = self.scheduler.admission_blocked or self.scheduler.num_running >= self.max_num_seqs
        return not self.scheduler.num_waiting or blocked

    def row_limit(self, req: Request, ahead: int) -> int | None:
        """Tokens a loop starting `ahead` tokens past the request's state may compute; None: host needed."""
        p = req.sampling_params
        # Stop strings are found in the text one step late: a one-step loop wastes at most that step on a stopped
        # row (its token is dropped: the request has finished when the step is applied); k steps would waste k.
        if (
            (p.stop and self.k > 1)
            or has_penalties(p)
            or p.logprobs is not None
            or req.num_output_tokens + ahead < p.min_tokens
        ):
            return None
        if p.constraint is not None or p.logit_bias:  # a grammar's mask comes from the host; the bias is in _sample
            return None
        return min(self.k, req.remaining_tokens(self.max_model_len) - ahead)

    def reserve(self, reqs: Sequence[Request], counts: Sequence[int]) -> bool:
        """Blocks for counts[i] positions of each request from its next token on (page copies made); False: some
        request could not get them (the blocks taken stay with their requests)."""
        cow: list[tuple[int, int]] = []
        ok = all(self.scheduler.reserve_lookahead([r], n - 1, cow) for r, n in zip(reqs, counts))
        self.runner.copy_blocks(cow)
        self._cow = bool(cow)  # a copied page changes a table entry in place: the persistent batch is rebuilt
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
            decode = len(sr.token_ids) == 1 and sr.sample and sr.start_pos >= sr.request.num_prompt_tokens
            n = self.row_limit(sr.request, 0) if decode else None  # a prompt's row (even of one token): a step
            if n is None:
                return None
            limits.append(n)
        if max(limits) < self.k or not self.reserve([sr.request for sr in out.scheduled], limits):
            return None
        return limits

    def launch(self, out: SchedulerOutput, limits: list[int]) -> InFlight:
        reqs = [sr.request for sr in out.scheduled]
        rows = [RowInput(sr.token_ids, sr.start_pos, sr.request.block_ids) for sr in out.scheduled]
        handle = self._dispatch(self.runner.pack_loop_rows(rows), sampling_tensors(reqs), reqs, limits, None)
        return InFlight([(sr.request, sr.start_pos) for sr in out.scheduled], limits, handle, out)

    def chain(self, cur: InFlight) -> InFlight | None:
        """The next loop for `cur`'s rows, dispatched before `cur` is read; None when the host is needed first."""
        if not self._room():
            return None
        reqs, starts, counts, index = [], [], [], []
        for i, ((req, start), n_cur) in enumerate(zip(cur.rows, cur.limits)):
            if req.status is not RequestStatus.RUNNING or self.scheduler.requests.get(req.request_id) is not req:
                continue  # aborted or finished since: nothing to chain
            n = self.row_limit(req, n_cur)
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
        if not self.reserve(reqs, ahead):
            return None
        batch, patched = self._batch, None
        if batch is not None and batch.handle is cur.handle and len(index) == len(cur.rows) and not self._cow:
            patched = batch.next(reqs, cur.limits)  # every row goes on: patch the persistent batch
        if patched is not None:
            inputs, st = patched
        else:
            inputs = self.runner.pack_loop_rows([RowInput([0], s, r.block_ids) for r, s in zip(reqs, starts)])
            st = sampling_tensors(reqs, [cur.limits[i] for i in index])
        handle = self._dispatch(inputs, st, reqs, counts, (cur.handle, index))
        self.num_chained += 1
        return InFlight(list(zip(reqs, starts)), counts, handle)

    def warm_chain(self) -> None:
        """Compiles a chained loop's token gather (runner.chain_tokens) for every (previous, next) row bucket: a
        chained loop keeps a subset of the previous loop's rows. The runner's warm-up left them to first use."""
        buckets, mesh = self.runner.decode_buckets, self.runner.mesh
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None))  # as loops return tokens
        for prev in buckets:
            prev_tokens = jax.device_put(jnp.zeros((self.k, prev), jnp.int32), sharding)
            for s in (b for b in buckets if b <= prev):
                idx = jnp.asarray(np.zeros(s, np.int32))
                jax.block_until_ready(chain_tokens(prev_tokens, idx, idx, np.zeros(s, np.int32)))

    def _dispatch(self, inputs: LoopInputs, st: SamplingTensors, reqs, limits, chain) -> LoopHandle:
        banned = np.full((self.k, len(reqs), 1), -1, np.int32)
        st = pad_sampling(st, inputs.tables.shape[0]) if st.step.shape[0] != inputs.tables.shape[0] else st
        self.num_loops += 1
        handle = self.runner.decode_loop(inputs, self.k, st, banned, np.asarray(limits, np.int32), chain=chain)
        self._batch = _Batch(handle, inputs, st, [len(r.block_ids) for r in reqs])
        # Queue the copy of this loop's results now, behind the loop itself: fetched only after the next loop was
        # dispatched, the copy ran after that loop too on the H200 (a profile at batch 64 / 256: 11.6 / 38 ms of idle
        # GPU between each loop's device-to-host copy and the next inputs), so the host applied with the GPU idle.
        handle.tokens.copy_to_host_async()
        handle.logprobs.copy_to_host_async()
        return handle

    def collect(self, cur: InFlight) -> StepResult:
        """Waits for `cur` and returns its result: per row, the loop's tokens and the KV positions it computed."""
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
        rows = []
        for sr in out.scheduled:
            i = by_id[sr.request_id]
            rows.append(RowResult(columns[i][: cur.limits[i]], None, int(cur.limits[i])))
        return StepResult(out, rows)
