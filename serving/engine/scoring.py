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
