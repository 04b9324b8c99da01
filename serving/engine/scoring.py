"""Batched log-probabilities of given continuations through the paged engine (rewards, perplexity, DPO losses).

    pairs (prompt ids, continuation ids)
      -> waves: the first pair of each distinct prompt, then the rest (whose prompts are cached by then)
      -> per pair a Request over the prompt: KVManager.lookup_prefix takes the cached blocks of prompt[:-1]
         (so position len(prompt) - 1, whose logits predict the first continuation token, is always computed),
         then the continuation is appended and blocks for every position up to the last but one are allocated
      -> steps under the token budget: each row's chunk asks for logits at the positions that predict a
         continuation token (RowInput.num_logits: they are always a suffix of the chunk)
      -> log_softmax at those logits, gathered at the next token, on the device
      -> release: the pair's full blocks (prompt and continuation) enter the prefix cache

    position   0 ...... P-2 | P-1 ..... P+C-2 | P+C-1      P = len(prompt), C = len(continuation)
    logits     not needed   | predict c0..c(C-1)  | not computed (nothing follows it)

Shared prompts are computed once (the second wave hits the radix cache), and a prompt cached by an earlier
`generate` or `score` call is not computed again. The engine must be idle (no request running): scoring uses the
scheduler's KVManager between engine steps, the way the scheduler would.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from serving.core.request import Request
from serving.engine.runner import RowInput


@dataclasses.dataclass(frozen=True)
class ScoreOutput:
    """Log-probabilities of one continuation given its prompt.

    Attributes:
      token_logprobs: float32 [len(continuation)]: log p(c_j | prompt, c_<j) under the engine's weights.
      logprob: their sum.
      num_cached_tokens: prompt tokens whose KV came from the prefix cache (not computed again).
    """

    token_logprobs: np.ndarray
    logprob: float
    num_cached_tokens: int


def require_idle(engine, action: str, drain: bool = False) -> None:
    """Raises RuntimeError while requests are unfinished, or with `drain` first runs them to completion (in the
    calling thread: only the thread that drives the engine may drain it)."""
    if drain:
        while engine.has_unfinished():
            engine.step()
    n = engine.scheduler.num_running + engine.scheduler.num_waiting
    if n:
        raise RuntimeError(
            f"{action}: {n} requests are unfinished (running or waiting) in the engine; let them finish, abort "
            "them, or pass drain=True to run them to completion first"
        )


@dataclasses.dataclass
class _Row:
    index: int
    req: Request
    prompt_len: int
    end: int  # positions 0 .. end - 1 are computed (end = P + C - 1)
    pos: int  # next position to compute
    cached: int
    logprobs: np.ndarray


@jax.jit
def _gather_logprobs(logits_lv, targets_l):
    """log_softmax(logits)[i, targets[i]] for every row i (float32)."""
    lp = jax.nn.log_softmax(logits_lv.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, targets_l[:, None], axis=-1)[:, 0]


def score(engine, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[ScoreOutput]:
    """Log-probabilities of each (prompt, continuation) pair (validated ids: both non-empty, within the vocabulary
    and max_model_len); see the module docstring."""
    require_idle(engine, "score")
    runner = engine.runner
    # Logits at every token of a step: the runner's logit buckets must reach the token budget (steps with fewer
    # logits keep their smaller buckets; these executables compile on first use).
    need = -(-engine.config.max_num_batched_tokens // engine.config.max_num_seqs)
    runner.max_logits_per_row = max(runner.max_logits_per_row, need)
    first, seen = [], set()
    for i, (prompt, _) in enumerate(pairs):
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            first.append(i)
    leaders = set(first)
    rest = [i for i in range(len(pairs)) if i not in leaders]
    results: list[ScoreOutput | None] = [None] * len(pairs)
    for wave in (first, rest):
        _run_wave(engine, pairs, wave, results)
    return results


def _admit(engine, index: int, prompt, continuation) -> _Row | None:
    """A row holding blocks for all its positions, or None (nothing held) when the pool cannot give them now."""
    kv = engine.scheduler.kv
    req = Request(f"score-{index}", list(prompt))
    hit = kv.lookup_prefix(req)
    for t in continuation:
        req.append_output(int(t))
    end = len(prompt) + len(continuation) - 1
    n = end - hit.num_tokens
    alloc = kv.allocate(req, n) if kv.can_allocate(req, n) else None
    if not alloc:
        kv.release(req)
        return None
    engine.runner.copy_blocks(alloc.cow_pairs)
    lp = np.zeros(len(continuation), np.float32)
    return _Row(index, req, len(prompt), end, hit.num_tokens, hit.num_tokens, lp)


def _run_wave(engine, pairs, wave: Sequence[int], results: list) -> None:
    kv, s = engine.scheduler.kv, engine.config.max_num_seqs
    pending, active = collections.deque(wave), []
    while pending or active:
        while pending and len(active) < s:
            row = _admit(engine, pending[0], *pairs[pending[0]])
            if row is None:
                if not active:
                    n = len(pairs[pending[0]][0]) + len(pairs[pending[0]][1])
                    raise ValueError(f"score: a pair of {n} tokens needs more KV blocks than the pool has free")
                break
            pending.popleft()
            active.append(row)
        _step(engine.runner, active, engine.config.max_num_batched_tokens)
        for row in [r for r in active if r.pos == r.end]:
            kv.release(row.req)
            active.remove(row)
            lp = row.logprobs
            results[row.index] = ScoreOutput(lp, float(lp.sum(dtype=np.float64)), row.cached)


def _step(runner, active: list[_Row], budget: int) -> None:
    """One runner step over chunks of the active rows; writes the continuation logprobs they produce."""
    rows, needed = [], []
    for r in active:
        take = min(r.end - r.pos, budget)
        if take <= 0:
            break
        full = r.req.all_token_ids
        first_needed = max(r.pos, r.prompt_len - 1)  # positions first_needed .. pos + take - 1 predict a token
        n_logits = r.pos + take - first_needed
        rows.append(RowInput(full[r.pos : r.pos + take], r.pos, list(r.req.block_ids), max(1, n_logits)))
        needed.append((r, first_needed, n_logits))
        budget -= take
        r.pos += take
        r.req.num_computed_tokens = r.pos
    logits = runner.forward(rows)
    targets = np.zeros(logits.shape[0], np.int32)
    spans, off = [], 0
    for (r, q0, n), row in zip(needed, rows):
        if n > 0:
            full = r.req.all_token_ids
            targets[off : off + n] = full[q0 + 1 : q0 + 1 + n]
            spans.append((r, q0, n, off))
        off += row.num_logits
    lp = np.asarray(_gather_logprobs(logits, jnp.asarray(targets)))
    for r, q0, n, off in spans:
        j = q0 - (r.prompt_len - 1)
        r.logprobs[j : j + n] = lp[off : off + n]


# Prompt logprobs beside running requests ----------------------------------------------------------------------

TOP_K = 20  # most alternatives per position an OpenAI completions request may ask for (logprobs <= 20)


@jax.jit
def _chunk_logprobs(logits_lv, targets_l):
    """(log p(target) [L], the TOP_K best ids [L, K], their logprobs [L, K]) per row, float32, on the device."""
    lp = jax.nn.log_softmax(logits_lv.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, TOP_K)
    return jnp.take_along_axis(lp, targets_l[:, None], axis=-1)[:, 0], top_ids, top_lp


class PromptLogprobs:
    """Teacher-forced logprobs of one prompt (OpenAI `echo` + `logprobs`), a chunk per call of `advance`.

    The server's engine thread calls `advance` between engine steps, so a long prompt never holds the engine for
    more than one chunk: each chunk is one runner step of at most `logit_buckets[0]` (max_num_seqs) positions,
    a shape warm-up compiled, with its logits reduced on the device to the target's logprob and the TOP_K best.
    The request's KV blocks come from the scheduler's pool a chunk at a time, like a prefill's, and enter the
    prefix cache at the end (a generation over the same prompt then reuses them). Host memory is O(prompt x k)
    numbers; device memory one chunk's logits.

        position   0 ....... P-2 | P-1
        logits     predict ids[1..P-1] | not needed (nothing follows it)

    Args:
      ids: the prompt's token ids (validated, within max_model_len).
      request_id: an id for the KV manager, unique among live requests.
    """

    def __init__(self, ids: Sequence[int], request_id: str):
        self.ids = [int(t) for t in ids]
        self.req = Request(request_id, list(self.ids))
        self.end = len(self.ids) - 1  # positions 0 .. end - 1 are computed
        self.pos = 0
        self.token_logprobs = np.zeros(max(self.end, 0), np.float32)
        self.top_ids = np.zeros((max(self.end, 0), TOP_K), np.int32)
        self.top_logprobs = np.zeros((max(self.end, 0), TOP_K), np.float32)
        self.holds_blocks = False

    @property
    def done(self) -> bool:
        return self.pos >= self.end

    def _chunk(self, engine) -> int:
        """Positions the next chunk computes: up to one logits bucket, and never a lone position where a bucket
        holds two (a one-token row would take the decode path: another logits shape); the extra position is the
        prompt's last, whose logits are not needed."""
        size = engine.runner.logit_buckets[0]
        return max(min(size, self.end - self.pos), min(size, 2))

    def next_positions(self, engine) -> int:
        """Positions the KV table covers after the next chunk (what decides its table width)."""
        return self.pos + self._chunk(engine)

    def advance(self, engine) -> bool:
        """Computes the next chunk; returns False (holding what it has) when the pool has no blocks for it now.

        Raises:
          ValueError: the pool cannot hold the prompt even with nothing else running.
        """
        if self.done:
            return True
        runner, kv = engine.runner, engine.scheduler.kv
        n = self._chunk(engine)
        self.req.num_computed_tokens = self.pos
        if not kv.can_allocate(self.req, n):
            if not engine.has_unfinished():
                self.release(engine)
                raise ValueError(f"the prompt's {len(self.ids)} tokens need more KV blocks than the pool has free")
            return False
        alloc = kv.allocate(self.req, n)
        if not alloc:
            return False
        self.holds_blocks = True
        runner.copy_blocks(alloc.cow_pairs)
        rows = [RowInput(self.ids[self.pos : self.pos + n], self.pos, list(self.req.block_ids), n)]
        logits = runner.forward(rows)
        used = min(n, self.end - self.pos)  # rows past `end`: the last position's logits, not needed
        targets = np.zeros(logits.shape[0], np.int32)
        targets[:used] = self.ids[self.pos + 1 : self.pos + 1 + used]
        lp, top_ids, top_lp = (np.asarray(a)[:used] for a in _chunk_logprobs(logits, jnp.asarray(targets)))
        span = slice(self.pos, self.pos + used)
        self.token_logprobs[span], self.top_ids[span], self.top_logprobs[span] = lp, top_ids, top_lp
        self.pos += used
        self.req.num_computed_tokens = self.pos + n - used
        if self.done:
            self.release(engine)
        return True

    def release(self, engine) -> None:
        """Gives the blocks back (computed full blocks enter the prefix cache); safe to call more than once."""
        if self.holds_blocks:
            engine.scheduler.kv.release(self.req)
            self.holds_blocks = False
