"""The engine's host-side sampler: a step's logits rows -> tokens, logprobs and top logprobs, for any request mix.

    logits [L, V] (device) --take_rows--> [s, V] (s: the row bucket) --logit bias--> --grammar mask (host, built
    while the forward pass runs)--> sample_rows: penalties, min_tokens bans, temperature / top-k / top-p / min-p,
    per-request seeds, logprobs --> host arrays of the first n rows

Rows pad to a decode bucket so one executable serves every row count of a bucket. Sampling parameters travel as
`SamplingTensors` built column-wise (`sampling_tensors`); the decode loops and the speculative paths build theirs
with the same function, so every path samples a request the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.sampling import SamplingTensors, pad_sampling, sample
from serving.core.request import Request
from serving.engine.structured import StructuredOutputs, sample_rows_masked

MAX_BANNED = 8  # token ids banned per row before min_tokens (EOS + stop ids); more are refused at add_request


class Sampler:
    """Samples requests from rows of a step's logits.

    Args:
      decode_buckets: the runner's row buckets (a call pads its rows to the smallest that holds them).
      structured: the grammar masks of constrained requests.
      on_dead_end: called with (request id, message) for a constrained row whose grammar allows no token; its
        sampled token is junk (the caller finishes the request, so the step's update skips it).
    """

    def __init__(
        self, decode_buckets: Sequence[int], structured: StructuredOutputs, on_dead_end: Callable[[str, str], None]
    ):
        self.decode_buckets = tuple(decode_buckets)
        self.structured = structured
        self.on_dead_end = on_dead_end

    def bucket(self, n: int) -> int:
        return next((b for b in self.decode_buckets if b >= n), n)

    def sample(self, logits, reqs: Sequence[Request], rows: Sequence[int] | None = None) -> list[np.ndarray]:
        """(tokens [n], logprobs [n], top ids [n, K], top logprobs [n, K]) on the host for reqs[i] from
        logits[rows[i]] (rows default: the first len(reqs))."""
        n = len(reqs)
        s = self.bucket(n)
        index = np.zeros(s, np.int32)  # padded to the bucket: one gather per (logits bucket, s), none per row count
        index[:n] = np.arange(n) if rows is None else rows
        logits = take_rows(logits, index)
        st = pad_sampling(sampling_tensors(reqs), s)
        penalties = any(has_penalties(r.sampling_params) for r in reqs)
        out_ids = _pad_ids([r.output_token_ids for r in reqs], s) if penalties else None
        prompt_ids = _pad_ids([r.prompt_token_ids for r in reqs], s) if penalties else None
        banned = banned_ids(reqs, s)
        num_lp = max((r.sampling_params.logprobs or 0) for r in reqs)
        num_lp = 0 if num_lp == 0 else (5 if num_lp <= 5 else 20)
        if any(r.sampling_params.logit_bias for r in reqs):
            logits = _add_logit_bias(logits, *_bias_arrays(reqs, s))
        mask, dead = self.structured.bitmask(reqs, s, banned)  # host, while the forward pass runs
        for rid, message in dead.items():
            self.on_dead_end(rid, message)
        if mask is None:
            result = sample_rows(logits, st, out_ids, prompt_ids, banned, num_logprobs=num_lp)
        else:
            result = sample_rows_masked(logits, st, out_ids, prompt_ids, banned, mask, num_logprobs=num_lp)
        return [np.asarray(a)[:n] for a in result]

    def warmup(self, logits_for: Callable[[int], jax.Array], logits_buckets: Sequence[int] = (), gather=True) -> None:
        """Compiles greedy / random sampling per row bucket on logits placed as `take_rows` returns rows of
        `logits_for(s)` (gather False: on `logits_for(s)` itself, as logits that reach the sampler from the host
        arrive), and the gathers of s rows out of every logits shape in `logits_buckets`."""
        for s in self.decode_buckets:
            logits = take_rows(logits_for(s), np.zeros(s, np.int32)) if gather else logits_for(s)
            banned = np.full((s, MAX_BANNED), -1, np.int32)
            st = SamplingTensors.from_rows([{}] * s)
            jax.block_until_ready(sample_rows(logits, st, None, None, banned, num_logprobs=0))
            for n in logits_buckets:
                take_rows(logits_for(n), np.zeros(s, np.int32))


def has_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def sampling_tensors(reqs: Sequence[Request], ahead: Sequence[int] | int = 0) -> SamplingTensors:
    """Per-row sampling parameters; `ahead`: tokens each row is past its request's state (a chained loop).

    Built column-wise from one tuple per row (one numpy conversion per dtype): this runs before every decode loop
    and verify pass, and a dict per row with a lookup per field cost ~30% of the host's work per loop at batch 64.
    """
    ahead = [ahead] * len(reqs) if isinstance(ahead, int) else ahead
    ps = [r.sampling_params for r in reqs]
    f = np.array(
        [(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in ps],
        np.float32,
    ).reshape(len(ps), 6)
    return SamplingTensors(
        temperature=f[:, 0],
        top_k=np.array([p.top_k for p in ps], np.int32),
        top_p=f[:, 1],
        min_p=f[:, 2],
        repetition_penalty=f[:, 3],
        presence_penalty=f[:, 4],
        frequency_penalty=f[:, 5],
        seed=np.array([p.seed % (2**32) for p in ps], np.uint32),
        step=np.array([r.num_output_tokens + a for r, a in zip(reqs, ahead)], np.int32),
    )


def logprob_entry(req: Request, token, lp, top_ids, top_lp):
    """One output token's logprobs entry: (its logprob, [(id, logprob)] of the request's top logprobs)."""
    n = req.sampling_params.logprobs or 0
    return (float(lp), [(int(i), float(v)) for i, v in zip(top_ids[:n], top_lp[:n])])


def banned_ids(reqs: Sequence[Request], s: int) -> np.ndarray:
    """[s, MAX_BANNED]: EOS and stop ids are banned for rows that have not reached min_tokens (-1: none)."""
    out = np.full((s, MAX_BANNED), -1, np.int32)
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            out[i, : min(MAX_BANNED, len(ids))] = ids[:MAX_BANNED]
    return out


@jax.jit
def take_rows(logits_lv: jax.Array, index_s: jax.Array) -> jax.Array:
    return jnp.take(logits_lv, index_s, axis=0)  # [s, V]


def _pad_ids(lists: Sequence[Sequence[int]], s: int) -> np.ndarray:
    width = 1 << max(4, (max((len(x) for x in lists), default=1) - 1).bit_length())
    out = np.full((s, width), -1, np.int32)
    for i, ids in enumerate(lists):
        out[i, : len(ids)] = ids
    return out


def _bias_arrays(reqs: Sequence[Request], s: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [s, N], biases [s, N]) of every row's logit_bias, N a power of two; padding adds 0 to token 0."""
    width = 1 << max(3, (max(len(r.sampling_params.logit_bias) for r in reqs) - 1).bit_length())
    ids = np.zeros((s, width), np.int32)
    vals = np.zeros((s, width), np.float32)
    for i, r in enumerate(reqs):
        for j, (tok, bias) in enumerate(r.sampling_params.logit_bias):
            ids[i, j], vals[i, j] = tok, bias
    return ids, vals


@jax.jit
def _add_logit_bias(logits, ids, vals):
    """logits [s, V] + each row's sparse bias (OpenAI logit_bias), before any other processing."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return logits.at[rows, ids].add(vals.astype(logits.dtype))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample_rows(logits, st, output_ids, prompt_ids, banned, num_logprobs: int = 0):
    """Jitted sampler over the first len(st) rows of logits."""
    return sample(logits[: st.temperature.shape[0]], st, output_ids, prompt_ids, banned, num_logprobs=num_logprobs)
