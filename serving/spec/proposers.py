"""Draft proposers for speculative decoding: one interface, and the proposers that need no model.

Each engine step, the scheduler gives every decode row a draft budget k_r (from serving/spec/policy.py); the
proposer drafts up to k_r tokens per row with the distribution q each was drawn from; the runner verifies all rows'
drafts in one target pass (1 + num_draft[r] query tokens per row, logits at each) and
`serving.spec.rule.rejection_sample` keeps the exact prefix. The proposer never decides correctness, only speed:
any drafts are fine as long as `draft_probs` is the distribution they were really drawn from.

    rows (histories, k per row) --propose--> Proposal(draft_tokens [B, k_max], num_draft [B], draft_probs | None)
                                                    |
    target pass over [last, drafts...] --> target_probs [B, k_max+1, V] --> rejection_sample --> accepted + 1 token
                                                    |
    observe(request_id, num_draft, num_accepted) <--+   (stateful proposers roll back; the policy updates its EMA)

Two kinds of proposer (`Proposer.after_schedule`):
  * host-side ones (n-gram) draft before the scheduler runs: the engine sets `Request.spec_token_ids`, and the
    scheduler trims them to its budget;
  * model proposers (`ModelDraftProposer`: a draft model, or self-speculation) write draft KV, so they draft after
    the scheduler has given each row blocks for its drafts: the engine asks for k placeholder drafts, and the
    proposer fills in `ScheduledRequest.num_draft` real ones, on `ProposalRow.block_table`.
Trained heads (Medusa / EAGLE, not built) would read the target's last hidden state from `ProposalRow.hidden`.
Host-side proposers (like the n-gram one) return numpy arrays; device proposers may return jax arrays of the same
shapes. Both are consumed only by the jitted verify step.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class ProposalRow:
    """One decode row asking for drafts.

    Attributes:
      request_id: stable id of the request (stateful proposers key their state by it).
      token_ids: the request's tokens so far (prompt + generated), the last one being the token the next target
        pass consumes first.
      k: the most drafts this row may get this step (0: none).
      hidden: optional target hidden state of the last position (for trained-head proposers).
      block_table: the request's KV blocks, covering len(token_ids) + k positions (model proposers).
    """

    request_id: Any
    token_ids: Sequence[int]
    k: int
    hidden: Any = None
    block_table: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class Proposal:
    """Drafts for a batch of rows.

    Attributes:
      draft_tokens: int32 [B, k_max]; row b's drafts are draft_tokens[b, :num_draft[b]], the rest is -1.
      num_draft: int32 [B], 0 <= num_draft[b] <= rows[b].k.
      draft_probs: float32 [B, k_max, V], the distribution each draft was drawn from, or None when q is one-hot
        at the draft token (deterministic proposers).
    """

    draft_tokens: Any
    num_draft: Any
    draft_probs: Any = None

    @property
    def k_max(self) -> int:
        return int(self.draft_tokens.shape[1])


class Proposer(abc.ABC):
    """Proposes up to k draft tokens per row, with their q."""

    name: str = "proposer"
    after_schedule: bool = False  # True: drafts once the rows have blocks for them (see the module docstring)

    @abc.abstractmethod
    def propose(self, rows: Sequence[ProposalRow]) -> Proposal:
        """Drafts for `rows`; `draft_tokens` is as wide as the largest k among them."""

    def observe(self, request_id: Any, num_draft: int, num_accepted: int) -> None:
        """After verification: `num_accepted` of the row's `num_draft` drafts were kept (stateful proposers roll
        back the rest). Stateless proposers ignore it."""
        del request_id, num_draft, num_accepted

    def release(self, request_id: Any) -> None:
        """The request finished or was preempted: drop any state kept for it."""
        del request_id


def check_rows(rows: Sequence[ProposalRow]) -> int:
    for r in rows:
        if r.k < 0:
            raise ValueError(f"request {r.request_id!r}: k must be >= 0, got {r.k}")
        if not len(r.token_ids):
            raise ValueError(f"request {r.request_id!r}: token_ids is empty")
    return max((r.k for r in rows), default=0)


class NgramProposer(Proposer):
    """Prompt lookup: match the history's last n tokens (n from max_n down to min_n) against its earlier tokens
    and propose the k tokens that followed its most recent occurrence. No model; q is one-hot (draft_probs None).

    A continuation that reaches the end of the history goes on copying from its own drafts: a match ending p
    tokens before the end proposes the history's last p tokens repeated (a repeating pattern proposes its own
    repetition). So a row gets k drafts whenever some n-gram matches, and none otherwise.

    Args:
      max_n / min_n: the longest and shortest suffix tried (longer matches first: they predict better).
      max_history: only the last `max_history` tokens are searched (bounds the per-step cost, O(max_history * n)).
    """

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, max_history: int = 4096):
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n ({max_n}) must be >= min_n ({min_n})")
        if max_history < max_n + 1:
            raise ValueError(f"max_history must be > max_n, got {max_history}")
        self.max_n, self.min_n, self.max_history = max_n, min_n, max_history

    def propose_one(self, token_ids: Sequence[int], k: int) -> np.ndarray:
        """Up to k draft tokens continuing `token_ids` (int32 [<= k])."""
        hist = np.asarray(token_ids[-self.max_history :], dtype=np.int64)
        n_tok = hist.size
        if k <= 0:
            return np.zeros(0, np.int32)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = hist[n_tok - n :]
            # Windows starting at j = 0 .. n_tok-1-n: each is followed by at least one token, and the window at
            # j = n_tok - n (the suffix itself) is excluded.
            windows = np.lib.stride_tricks.sliding_window_view(hist[: n_tok - 1], n)  # [n_tok - n, n]
            hits = np.flatnonzero(np.all(windows == suffix, axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence
                out = np.empty(k, np.int32)
                for i in range(k):  # past the history's end the copy continues from its own drafts (period)
                    idx = start + i
                    out[i] = hist[idx] if idx < n_tok else out[idx - n_tok]
                return out
        return np.zeros(0, np.int32)

    def propose(self, rows: Sequence[ProposalRow]) -> Proposal:
        k_max = check_rows(rows)
        draft = np.full((len(rows), k_max), -1, np.int32)
        num = np.zeros(len(rows), np.int32)
        for i, r in enumerate(rows):
            toks = self.propose_one(r.token_ids, r.k)
            draft[i, : toks.size] = toks
            num[i] = toks.size
        return Proposal(draft, num, None)


class ReplayProposer(Proposer):
    """Benchmark proposer at a controlled acceptance: drafts the target's own greedy continuation (recorded from
    an earlier run of the same requests), each draft token kept with probability `acceptance` and otherwise
    replaced by a different token. Under greedy decoding a kept token is exactly what the target emits (when the
    recording is the same model's greedy output), so each draft is accepted with probability `acceptance` until the
    first corrupted one: the acceptance of a real proposer, at no drafting cost (the serving cost of speculation
    is the verify pass). For performance work on random weights, where no real proposer predicts anything.

    Args:
      sequences: prompt + greedy continuation token ids, one per request; a row is matched to the sequence whose
        prompt its history starts with (the longest such prompt). Rows with no match, or past the recording's
        end, get no drafts.
      prompt_lens: the prompt length of each sequence.
      acceptance: probability that a draft token is the recorded one, in [0, 1].
      vocab_size: corrupted tokens are drawn from [0, vocab_size).
      seed: the corruption's random stream.
    """

    name = "replay"

    def __init__(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        acceptance: float,
        vocab_size: int,
        seed: int = 0,
    ):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.acceptance, self.vocab_size = float(acceptance), int(vocab_size)
        self._by_prompt: dict[tuple, list[int]] = {}
        for seq, n in zip(sequences, prompt_lens):
            self._by_prompt[tuple(seq[:n])] = list(seq)
        self._lens = sorted({len(p) for p in self._by_prompt}, reverse=True)
        self._rng = np.random.default_rng(seed)
        self._match: dict[Any, list[int] | None] = {}
        self.tracked: set = set()

    def _sequence(self, row: ProposalRow) -> list[int] | None:
        if row.request_id not in self._match:
            hist = tuple(row.token_ids)
            found = next((self._by_prompt[hist[:n]] for n in self._lens if hist[:n] in self._by_prompt), None)
            self._match[row.request_id] = found
            self.tracked.add(row.request_id)
        return self._match[row.request_id]

    def propose(self, rows: Sequence[ProposalRow]) -> Proposal:
        k_max = check_rows(rows)
        draft = np.full((len(rows), k_max), -1, np.int32)
        num = np.zeros(len(rows), np.int32)
        for i, r in enumerate(rows):
            seq = self._sequence(r)
            pos = len(r.token_ids)
            if seq is None or r.k == 0 or list(seq[:pos]) != list(r.token_ids):  # off the recording: no drafts
                continue
            toks = np.asarray(seq[pos : pos + r.k], np.int64)
            corrupt = self._rng.random(toks.size) >= self.acceptance
            # A corrupted token differs from the recorded one: shifted by 1 .. V-1 (mod V).
            shift = self._rng.integers(1, self.vocab_size, toks.size)
            toks = np.where(corrupt, (toks + shift) % self.vocab_size, toks)
            draft[i, : toks.size] = toks
            num[i] = toks.size
        return Proposal(draft, num, None)

    def release(self, request_id: Any) -> None:
        self._match.pop(request_id, None)
        self.tracked.discard(request_id)


def replay_greedy(proposer: Proposer, prompt: Sequence[int], generated: Sequence[int], k: int) -> dict:
    """What speculative greedy decoding with `proposer` would have done on an already generated greedy sequence.

    Under greedy decoding the output is the target's argmax chain whatever the drafts, so the accepted prefix of a
    draft is its longest prefix equal to the tokens actually generated next. Walks the sequence pass by pass: each
    pass proposes up to k tokens, accepts the matching prefix and emits it plus one target token.

    Returns:
      dict with passes, tokens (generated), drafted, accepted (draft tokens), proposed_passes (passes with >= 1
      draft), and acceptance = accepted / trials, the per-token acceptance estimate, where a pass with d drafts
      and m accepted contributes m successes out of m + (1 if m < d else 0) Bernoulli trials (acceptance stops
      at the first rejection, so later drafts were never tested).
    """
    seq = list(prompt) + list(generated)
    pos, passes, drafted, accepted, trials, proposed = len(prompt), 0, 0, 0, 0, 0
    while pos < len(seq):
        remaining = len(seq) - pos
        drafts = proposer.propose([ProposalRow(passes, seq[:pos], min(k, remaining - 1))])
        d = int(drafts.num_draft[0])
        target = seq[pos : pos + d]
        m = 0
        while m < d and int(drafts.draft_tokens[0, m]) == target[m]:
            m += 1
        passes += 1
        drafted += d
        accepted += m
        trials += m + (1 if m < d else 0)
        proposed += d > 0
        pos += m + 1
    return dict(
        passes=passes,
        tokens=len(generated),
        drafted=drafted,
        accepted=accepted,
        trials=trials,
        proposed_passes=proposed,
        acceptance=accepted / trials if trials else 0.0,
    )
