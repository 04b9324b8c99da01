"""Model proposers: a draft model with its own paged KV on the request's block tables, and self-speculation.

    propose(rows: token ids, k, block table)                                       after the scheduler gave blocks
      1. catch-up: ragged steps over the tokens whose draft KV is missing       runner.forward, chunked to budget
      2. k greedy draft steps from the row's last token, in one jitted loop     runner.decode_loop (lax.fori_loop)
      -> Proposal(draft tokens [B, k_max], num_draft [B], draft_probs None)

The draft's KV lives in pages with the same ids as the target's (the request's block table), in the draft's own
pool, so the scheduler's allocation, rollback and preemption cover both. What the draft wrote is valid while the
request's table keeps the same blocks: `_valid[r]` is the position below which the draft KV of request r is right,
cut back when a verify pass rejects drafts (`observe`) and to the first block that changed (copy-on-write,
preemption, a new request on recycled blocks). Positions past it are recomputed by the catch-up, so stale pages
cost only time; they can never change the output (that is the rejection sampler's job: drafts only speed up).

Drafts are greedy (the argmax of the draft's logits): a deterministic proposer, so q is one-hot at the draft token
and `rejection_sample` gets draft_probs=None. That is exact for greedy and sampled targets alike; a sampled
target accepts a draft with probability p(draft).

Self-speculation is a draft model made of the target's first L layers with its final norm and head (the same
arrays: no extra weights). Its KV is the target's own first L layers (`target=` below): the target's verify pass
has already written them for every committed position, so there is no catch-up; the draft's provisional writes
land at the positions the verify pass overwrites next.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from model.sampling import SamplingTensors
from model.transformer import Transformer, abstract_model, build_model
from serving.engine.runner import ModelRunner, RowInput
from serving.spec.proposers import Proposal, ProposalRow, Proposer, check_rows


def truncated_model(model: Transformer, num_layers: int) -> Transformer:
    """The target's first `num_layers` blocks with its embedding, final norm and head (the same arrays)."""
    if not 1 <= num_layers < model.cfg.num_layers:
        raise ValueError(
            f"speculative_draft_layers must be in [1, {model.cfg.num_layers}) for this model, got {num_layers}"
        )
    cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    draft = abstract_model(cfg, model.dtype)
    # The target's own variables, whole (fused q|k|v and gate|up slots included): nnx.update assigns, never copies.
    state = nnx.state(model)
    state["layers"] = nnx.State({i: state["layers"][i] for i in range(num_layers)})
    nnx.update(draft, state)
    return draft


class ModelDraftProposer(Proposer):
    """Greedy drafts from a model run by its own ModelRunner (module docstring).

    Args:
      runner: the draft's runner (same block_size, max_model_len and max_num_seqs as the target's).
      name: the method name, for metrics.
      target: for self-speculation, the target's runner: the draft reads and writes the target's first L layers'
        KV pages instead of a pool of its own.
    """

    after_schedule = True

    def __init__(self, runner: ModelRunner, name: str = "draft", target: ModelRunner | None = None):
        self.runner, self.name, self._target = runner, name, target
        self._valid: dict[Any, int] = {}  # request -> draft KV right below this position
        self._tables: dict[Any, list[int]] = {}  # request -> the block table the draft last wrote with
        self._proposed: dict[Any, tuple[int, int]] = {}  # request -> (its token count, k) at the last proposal

    @property
    def shares_target_kv(self) -> bool:
        """Self-speculation: the draft reads and writes the target's first layers' KV (no pool of its own)."""
        return self._target is not None

    def catch_up_rows(self, rows: Sequence[ProposalRow]) -> None:
        """Makes the draft's KV right below each row's last token (before a loop that keeps it so from there)."""
        self._catch_up([(row, self._valid_from(row)) for row in rows])

    def _valid_from(self, r: ProposalRow) -> int:
        n = len(r.token_ids)
        if self._target is not None:
            return n - 1  # the target's verify pass wrote these layers' KV for every committed position
        old, new = self._tables.get(r.request_id, []), list(r.block_table)
        same = 0
        while same < min(len(old), len(new)) and old[same] == new[same]:
            same += 1
        return min(self._valid.get(r.request_id, 0), same * self.runner.block_size, n - 1)

    @contextlib.contextmanager
    def _kv(self):
        """Self-speculation: lend the target's first L layers' KV pages to the draft runner for one proposal."""
        if self._target is None:
            yield
            return
        n = self.runner.cfg.num_layers
        self.runner.kv_cache = self._target.kv_cache[:n]
        try:
            yield
        finally:
            self._target.kv_cache = list(self.runner.kv_cache) + list(self._target.kv_cache[n:])

    def _catch_up(self, items: Sequence[tuple[ProposalRow, int]]) -> None:
        """Computes draft KV for positions start .. len(token_ids) - 2 of every row, in steps within budget."""
        budget, max_rows = self.runner.token_buckets[-1], self.runner.max_num_seqs
        todo = [(r, s) for r, s in items if s < len(r.token_ids) - 1]
        while todo:
            batch, rest, used = [], [], 0
            for r, s in todo:
                if len(batch) == max_rows or used >= budget:
                    rest.append((r, s))
                    continue
                end = min(len(r.token_ids) - 1, s + budget - used)
                batch.append(RowInput(list(r.token_ids[s:end]), s, list(r.block_table)))
                used += end - s
                if end < len(r.token_ids) - 1:
                    rest.append((r, end))
            self.runner.forward(batch)  # logits unused; the KV writes are the point
            todo = rest

    def propose(self, rows: Sequence[ProposalRow]) -> Proposal:
        k_max = check_rows(rows)
        draft = np.full((len(rows), k_max), -1, np.int32)
        num = np.zeros(len(rows), np.int32)
        live = [(i, r) for i, r in enumerate(rows) if r.k > 0]
        if not live:
            return Proposal(draft, num, None)
        if any(r.block_table is None for _, r in live):
            raise ValueError(f"{self.name} proposer: rows need their block_table (it drafts after scheduling)")
        with self._kv():
            self._catch_up([(r, self._valid_from(r)) for _, r in live])
            loop_rows = [RowInput([int(r.token_ids[-1])], len(r.token_ids) - 1, list(r.block_table)) for _, r in live]
            limits = np.asarray([r.k for _, r in live], np.int32)
            greedy = SamplingTensors.from_rows([{}] * len(live))
            banned = np.full((k_max, len(live), 1), -1, np.int32)
            tokens, _ = self.runner.decode_loop(loop_rows, k_max, greedy, banned, limits).fetch()  # [k_max, n]
        for j, (i, r) in enumerate(live):
            draft[i, : r.k] = tokens[: r.k, j]
            num[i] = r.k
            self._tables[r.request_id] = list(r.block_table)
            self._proposed[r.request_id] = (len(r.token_ids), r.k)
        return Proposal(draft, num, None)

    def observe(self, request_id: Any, num_draft: int, num_accepted: int) -> None:
        """The draft wrote positions n-1 .. n+k-2 from inputs [last, d_0 .. d_{k-2}]: those up to the accepted
        prefix stay right."""
        n, k = self._proposed.pop(request_id, (None, None))
        if n is not None and self._target is None:
            self._valid[request_id] = n + min(num_accepted, k - 1)

    def loop_done(self, request_id: Any, valid: int, block_table: Sequence[int]) -> None:
        """The on-device speculative loop (device_loop.py) left the draft KV right below `valid` on this table."""
        self._proposed.pop(request_id, None)
        if self._target is None:
            self._valid[request_id], self._tables[request_id] = valid, list(block_table)

    def release(self, request_id: Any) -> None:
        for d in (self._valid, self._tables, self._proposed):
            d.pop(request_id, None)

    @property
    def tracked(self) -> set:
        """Requests with draft state (the engine releases those that left)."""
        return set(self._valid) | set(self._tables) | set(self._proposed)


def runner_like(target: ModelRunner, model: Transformer, num_blocks: int | None = None) -> ModelRunner:
    """A runner for a draft `model` on the target's geometry (block size, rows, token budget, context, kernels,
    mesh), with a KV pool of `num_blocks` (default: the target's, so the same block ids address both pools)."""
    return ModelRunner(
        model,
        num_blocks=target.num_blocks if num_blocks is None else num_blocks,
        block_size=target.block_size,
        max_num_seqs=target.max_num_seqs,
        max_num_batched_tokens=target.token_buckets[-1],
        max_model_len=target.max_blocks * target.block_size,
        attention_backend=target.backend,
        mesh=target.mesh,
    )


def make_model_proposer(method: str, target: ModelRunner, model: Transformer, spec, dtype) -> ModelDraftProposer:
    """The proposer for speculative_method "draft" (load `spec.speculative_model`) or "self" (truncate `model`)."""
    if method == "self":
        layers = spec.speculative_draft_layers or max(1, model.cfg.num_layers // 2)
        draft, blocks = truncated_model(model, layers), 2  # a token pool: the target's pages are lent per call
    else:
        from checkpoints.loader import load_checkpoint

        ckpt = load_checkpoint(spec.speculative_model)
        if ckpt.config.vocab_size != model.cfg.vocab_size:
            raise ValueError(
                f"speculative_model {spec.speculative_model!r}: vocabulary {ckpt.config.vocab_size} != the "
                f"target's {model.cfg.vocab_size} (the draft must share the tokenizer)"
            )
        draft, blocks = build_model(ckpt.config, ckpt.params, dtype), target.num_blocks
    return ModelDraftProposer(runner_like(target, draft, blocks), method, target if method == "self" else None)
