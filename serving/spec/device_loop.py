"""Speculative decoding inside the on-device decode loop: drafting (n-gram, trained Medusa heads or a draft model),
verification and acceptance per iteration.

The host-side speculative step (serving/spec/verify.py) pays one host round trip per verify pass (~20 ms on the
H200 with the host's work and dispatch gaps), while a pass over k + 1 tokens costs about what a one-token step does:
per-pass overheads eat the gain. Here `num_steps` passes run inside one jitted `lax.while_loop`, like the plain
decode loop (runner._loop_fn), so the round trip is paid once per loop. Per iteration, for every row:

    draft     prompt lookup on the row's token history [S, H] (the last max_history tokens of prompt + output when
              the loop starts, then its own tokens; `offset` = the positions before it): the k tokens that followed
              the most recent earlier occurrence of its last n tokens, n from max_n down to min_n, exactly
              NgramProposer's rule (`ngram_drafts`); no match (or the policy gave the row k = 0): no drafts
              medusa: the heads on h, the target's hidden state whose logits drew the row's last token (carried
              from iteration to iteration, in and out of the loop through MedusaProposer.record): k tokens drawn
              from each head's processed q (head_proposer.draw_drafts, the host path's rule); a row without a
              current h drafts nothing in its first iteration, whose verify pass yields one
              draft model / self-speculation: k + 1 greedy decode steps of the draft from the row's last token
              (`model_drafts`; q one-hot), writing the draft's own paged KV (same block ids, its pool; self: the
              target's first L layers, which the verify pass then overwrites): the (k+1)-th step's token is
              dropped, its KV write keeps the draft KV complete when every draft is accepted, so after a accepted
              drafts the draft KV is right up to the row's new last token and the next iteration needs no catch-up
    verify    one ragged pass of k + 1 query tokens per row (cu_q_lens = (k + 1) * row), logits at every one
    accept    greedy rows: the longest prefix of drafts equal to the argmax, then the argmax; sampled rows:
              rejection_sample on processed_target_probs with q (one-hot for n-gram), keys row_keys(seed, tokens
              generated)
    advance   emitted tokens (capped at the row's remaining limit, cut after a stop id) go to the history and to
              the output buffer [num_steps * (k + 1), S]; the row's position moves by their count

KV: a pass writes positions pos .. pos + k; those past the accepted length hold rejected drafts and are overwritten
by the next pass (which writes its own positions before attending to them), or lie past the row's computed length
when the loop ends (the scheduler rolls nothing back: the next step writes them first). Positions at or past
start + limit (the blocks reserved, DecodeLoops.reserve) go to the null page; the block table is padded inside the
loop so the kernel never reads past it. A row past its limit, or stopped, writes only the null page.

The engine takes this path when speculation is on with any proposer (draft model: the host's catch-up makes its KV
right below each row's last token first, ModelDraftProposer.catch_up_rows), `speculative_device_loop` is
set, the policy gives some row drafts (medusa: also when it gives none, so the hidden states stay current), and every
row is a decode row that a plain decode loop could take (no stop strings, penalties, logprobs, min_tokens, grammar
or logit bias: DecodeLoops.row_limit). With one compiled k the pass costs
the same whatever a row drafts, so the policy's k per row only chooses between drafting (all k) and not (0).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.kv import PagedMeta
from model.sampling import SamplingTensors, pad_sampling
from serving.core.request import Request, RequestStatus
from serving.core.scheduler_output import RowResult, SchedulerOutput, StepResult
from serving.engine.sampler import sampling_tensors
from serving.spec.draft_model import ModelDraftProposer
from serving.spec.head_proposer import MedusaProposer, draw_drafts
from serving.spec.proposers import NgramProposer, ProposalRow
from serving.spec.rule import processed_target_probs, rejection_sample, row_keys

MAX_STOP_IDS = 8  # stop ids per row the loop stops on (the scheduler applies every one anyway: this only saves work)


def _source_hash() -> str:
    """Key part for the executable cache, whose fingerprint covers the runner but not this module's traced code."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (__file__, os.path.join(here, "rule.py")):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def ngram_drafts(hist_sh, length_s, k: int, max_n: int, min_n: int, max_history: int):
    """NgramProposer.propose_one on device: (drafts int32 [S, k], found bool [S]) for histories hist[s, :length[s]].

    A window of n tokens ending at e matches the last n tokens iff hist[e - t] == hist[L - 1 - t] for t < n, so the
    matches of n + 1 are those of n and one more comparison. Windows must start at or after L - max_history, end
    before the last token (e <= L - 2), and n <= min(L, max_history) - 1; the longest matching n wins, then the most
    recent window (largest e). The drafts continue from start = e + 1 with period L - start (a continuation past the
    end copies its own drafts, as NgramProposer does).
    """
    s, h = hist_sh.shape
    e = jnp.arange(h)[None, :]
    length = length_s[:, None]
    n_tok = jnp.minimum(length, max_history)
    lo = length - n_tok
    match = jnp.ones((s, h), bool)
    best_e = jnp.zeros(s, jnp.int32)
    found = jnp.zeros(s, bool)
    for n in range(1, max_n + 1):
        t = n - 1  # this n adds the comparison hist[e - t] == hist[L - 1 - t]
        last_t = jnp.take_along_axis(hist_sh, jnp.maximum(length - 1 - t, 0), axis=1)  # [S, 1]
        match = match & (jnp.roll(hist_sh, t, axis=1) == last_t)  # wrapped entries (e < t) fail `e - t >= lo`
        if n < min_n:
            continue
        ok = match & (e - t >= lo) & (e <= length - 2) & (n <= n_tok - 1)
        hit = jnp.any(ok, axis=1)
        last = jnp.max(jnp.where(ok, e, -1), axis=1).astype(jnp.int32)
        best_e = jnp.where(hit, last, best_e)  # a longer n overrides a shorter one
        found = found | hit
    start = best_e + 1
    period = jnp.maximum(length_s - start, 1)
    idx = start[:, None] + jnp.arange(k)[None, :] % period[:, None]
    drafts = jnp.take_along_axis(hist_sh, jnp.clip(idx, 0, h - 1), axis=1)
    return drafts.astype(jnp.int32), found


def model_drafts(model, kv, tok_s, pos_s, tables, active_s, cover_s, steps: int, k: int, meta_args: tuple):
    """(drafts int32 [S, k], kv): `steps` (k or k + 1) greedy decode steps of `model` from tokens tok_s at positions
    pos_s, each writing its input's KV (positions at or past cover_s, or of inactive rows: the null page)."""
    s = tok_s.shape[0]
    rows, cu, bs = jnp.arange(s), jnp.arange(s + 1, dtype=jnp.int32), meta_args[0]

    def body(j, carry):
        tok, kv, drafts = carry
        pos = pos_s + j
        real = active_s & (pos < cover_s)
        slots = jnp.where(real, tables[rows, jnp.minimum(pos // bs, tables.shape[1] - 1)] * bs + pos % bs, 0)
        meta = PagedMeta(slots, tables, jnp.where(active_s, pos + 1, 0), cu, jnp.int32(s), True, *meta_args[1:])
        logits, kv = model(tok[None], pos[None], kv, meta, rows[None], active_s[None])
        nxt = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
        return nxt, kv, drafts.at[:, j].set(nxt, mode="drop")  # step k's token is dropped: its KV write is the point

    _, kv, drafts = jax.lax.fori_loop(0, steps, body, (tok_s, kv, jnp.zeros((s, k), jnp.int32)))
    return drafts, kv


def accept(logits_skv, drafts_sk, num_draft_s, st: SamplingTensors, draft_probs=None):
    """(tokens [S, k+1], num_emitted [S]) of one verify pass: greedy rows take the argmax chain up to the first
    draft that differs; sampled rows (temperature > 0) the rejection rule on the processed target probs against
    `draft_probs` [S, k, V] (None: one-hot drafts, as prompt lookup's; one lax.cond: an all-greedy batch skips the
    vocabulary sort). A greedy row's drafts must then be the argmax of its q (one-hot), as draw_drafts makes them."""
    k = drafts_sk.shape[1]
    argmax = jnp.argmax(logits_skv, axis=-1).astype(jnp.int32)  # [S, k+1]
    same = (drafts_sk == argmax[:, :k]) & (jnp.arange(k)[None, :] < num_draft_s[:, None])
    n_greedy = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=1), axis=1) + 1

    def sampled(_):
        probs = processed_target_probs(logits_skv, st)
        return rejection_sample(probs, draft_probs, drafts_sk, num_draft_s, row_keys(st.seed, st.step))

    tok_s, n_s = jax.lax.cond(jnp.any(st.temperature > 0), sampled, lambda _: (argmax, n_greedy), None)
    hot = st.temperature > 0
    return jnp.where(hot[:, None], tok_s, argmax), jnp.where(hot, n_s, n_greedy).astype(jnp.int32)


def spec_loop_fn(runner, num_steps: int, k: int, drafter: tuple):
    """The jitted loop: (params, kv, hist [S, H], length [S], offset [S], tables [S, W], limits [S], draft_on [S],
    stop_ids [S, MAX_STOP_IDS], st) -> (tokens [num_steps*(k+1), S], stats [1 + 2*num_steps, S], kv, router counts).
    Row s's tokens are hist[s, :length[s]], at positions offset[s] onwards; the last one is the loop's first input.

    `drafter`: ("ngram", max_n, min_n, max_history), prompt lookup on the history; or ("medusa", heads graphdef),
    trained heads on the hidden state whose logits drew the row's last token. The medusa loop takes three more
    arguments, (heads state, h [S, D], has_h [S] bool: h is current), and returns (stats, h, has_h) in place of
    stats: a row without a current h drafts nothing in its first iteration, whose verify pass records one. Or
    ("model", draft graphdef, L): a draft model's greedy steps, the loop takes the draft params more; L = 0: its
    own paged KV, whose layers follow the target's in kv (in and out); L > 0 (self-speculation): the target's
    first L layers' KV.

    stats row 0: tokens each row emitted; rows 1..num_steps: drafts per iteration; the last num_steps rows: tokens
    emitted per iteration. The output tree is the plain loop's (tokens, one array or the medusa triple, kv,
    counts), so the runner's executable cache loads it as a loop (a draft's own KV layers: SpecLoops._out_tree).
    """
    graphdef, backend, bs, mesh, cfg = runner.graphdef, runner.backend, runner.block_size, runner.mesh, runner.cfg
    k1 = k + 1
    medusa, kind = drafter[0] == "medusa", drafter[0]
    shared = drafter[2] if kind == "model" else 0  # self-speculation: the draft's KV is the target's first layers
    own_kv = kind == "model" and not shared  # the draft's own KV layers follow the target's in `kv`
    n_t = cfg.num_layers

    def loop(params, kv, hist, length, offset, tables, limits, draft_on, stop_ids, st, *extra):
        model = nnx.merge(graphdef, params)
        s = hist.shape[0]
        rows = jnp.arange(s)
        cu = (jnp.arange(s + 1) * k1).astype(jnp.int32)
        cover = offset + length - 1 + limits  # positions below this have reserved blocks
        tables = jnp.pad(tables, ((0, 0), (0, -(-k1 // bs) + 1)))  # kv_len up to cover + k stays inside the table
        aux = ()  # what the drafter carries: medusa (h, has_h)
        if medusa:
            heads, aux = nnx.merge(drafter[1], extra[0]), tuple(extra[1:])
        elif kind == "model":
            dmodel = nnx.merge(drafter[1], extra[0])

        def draft(hist, length, aux, kv, active, st_i):
            """(drafts [S, k], found [S], q [S, k, V] or None, aux, kv) for this iteration."""
            if medusa:
                drafts, q = draw_drafts(heads, model, aux[0], st_i, k)
                return drafts, aux[1], q, aux, kv
            if kind == "model":
                lo, hi = (0, shared) if shared else (n_t, len(kv))
                tok, pos, meta_args = hist[rows, length - 1], offset + length - 1, (bs, backend, mesh)
                steps = k + (not shared)
                drafts, dkv = model_drafts(dmodel, kv[lo:hi], tok, pos, tables, active, cover, steps, k, meta_args)
                return drafts, jnp.ones(s, bool), None, aux, [*kv[:lo], *dkv, *kv[hi:]]
            return (*ngram_drafts(hist, length, k, *drafter[1:]), None, aux, kv)

        j = jnp.arange(k1)[None, :]
        out_len = num_steps * k1

        def cond(carry):
            i, _, _, _, _, count, done, _, _, _ = carry
            return (i < num_steps) & jnp.any((count < limits) & ~done)

        def body(carry):
            i, hist, length, kv, out_tok, count, done, stats, routed, aux = carry
            active = (count < limits) & ~done
            st_i = dataclasses.replace(st, step=st.step + count)
            drafts, found, q, aux, kv = draft(hist, length, aux, kv, active, st_i)
            room = jnp.clip(limits - count - 1, 0, k)  # drafts past the row's limit could never be emitted
            num_draft = jnp.where(found & (draft_on > 0) & active, room, 0).astype(jnp.int32)
            pos = (offset + length - 1)[:, None] + j  # [S, k+1]
            tok = jnp.concatenate([hist[rows, length - 1][:, None], drafts], axis=1)
            real = active[:, None] & (pos < cover[:, None])
            page = tables[rows[:, None], jnp.minimum(pos // bs, tables.shape[1] - 1)]
            slots = jnp.where(real, page * bs + pos % bs, 0)
            kv_lens = (offset + length + k).astype(jnp.int32)
            meta = PagedMeta(slots.reshape(-1), tables, kv_lens, cu, jnp.int32(s), False, backend, mesh)
            valid = jnp.repeat(active, k1)[None]
            logits, tkv, counts, *hidden = model(
                tok.reshape(1, -1), pos.reshape(1, -1), kv[:n_t] if own_kv else kv, meta, None, valid, True, medusa
            )
            kv = [*tkv, *kv[n_t:]] if own_kv else tkv
            emitted, n_emit = accept(logits[0].reshape(s, k1, -1), drafts, num_draft, st_i, q)
            n_emit = jnp.where(active, jnp.minimum(n_emit, limits - count), 0)
            is_stop = jnp.any(emitted[:, :, None] == jnp.where(stop_ids >= 0, stop_ids, -2)[:, None, :], axis=2)
            is_stop = is_stop & (j < n_emit[:, None])
            stopped = jnp.any(is_stop, axis=1)
            n_emit = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, n_emit).astype(jnp.int32)
            keep = j < n_emit[:, None]
            out_tok = out_tok.at[jnp.where(keep, count[:, None] + j, out_len), rows[:, None]].set(emitted, mode="drop")
            hist = hist.at[rows[:, None], jnp.where(keep, length[:, None] + j, hist.shape[1])].set(emitted, mode="drop")
            stats = stats.at[1 + i].set(num_draft).at[1 + num_steps + i].set(n_emit)
            count = count + n_emit
            if medusa:  # the state at the last emitted token's query index drew it: the next drafts continue it
                (h, has_h), h_new = aux, hidden[0][0].reshape(s, k1, -1)[rows, jnp.maximum(n_emit - 1, 0)]
                aux = jnp.where((n_emit > 0)[:, None], h_new.astype(h.dtype), h), has_h | (n_emit > 0)
            carry = hist, length + n_emit, kv, out_tok, count, done | stopped, stats, routed + counts, aux
            return i + 1, *carry

        zeros = jnp.zeros(s, jnp.int32)
        routed = jnp.zeros((cfg.num_layers, cfg.num_experts), jnp.int32)
        out_tok = jnp.zeros((out_len, s), jnp.int32)
        stats = jnp.zeros((1 + 2 * num_steps, s), jnp.int32)
        init = (jnp.int32(0), hist, length, kv, out_tok, zeros, zeros > 0, stats, routed, aux)
        _, _, _, kv, out_tok, count, _, stats, routed, aux = jax.lax.while_loop(cond, body, init)
        stats = stats.at[0].set(count)
        return out_tok, (stats, *aux) if medusa else stats, kv, routed

    return jax.jit(loop, donate_argnums=(1,))


@dataclasses.dataclass(frozen=True)
class SpecLoopResult:
    """A spec loop's results on the host, for its first num_rows rows."""

    tokens: np.ndarray  # [num_steps * (k + 1), num_rows]
    counts: np.ndarray  # [num_rows] tokens emitted
    drafted: np.ndarray  # [num_steps, num_rows] drafts per iteration (0: the row did not draft, or was done)
    emitted: np.ndarray  # [num_steps, num_rows] tokens emitted per iteration


class SpecLoops:
    """Decides when a step runs the on-device speculative loop, runs it, and feeds the policy and counters.

    Called by the engine: `plan()` before the scheduler (True: this step's decode rows get no host drafts, the
    loop drafts on device), then `run(out)` after it (None: run the step another way).
    """

    def __init__(self, spec, loops, enabled: bool = True):
        """spec: the engine's SpecDecoder (None: speculation off); loops: its DecodeLoops (row limits, block
        reservations, and the scheduler, runner and decode_steps they hold)."""
        self.spec, self.loops = spec, loops
        self.enabled = enabled
        self.num_loops = 0
        self._draft_on: dict[str, bool] | None = None
        self._tag = _source_hash()

    runner = property(lambda self: self.loops.runner)
    scheduler = property(lambda self: self.loops.scheduler)
    num_steps = property(lambda self: max(1, self.loops.k))

    @property
    def proposer(self) -> NgramProposer | MedusaProposer | ModelDraftProposer | None:
        spec = self.spec
        kinds = NgramProposer | MedusaProposer | ModelDraftProposer
        ok = self.enabled and spec is not None and isinstance(spec.proposer, kinds)
        # Several processes replay the leader's runner calls (sharding/multihost.py), which know no spec loop yet:
        # there the host verify path runs.
        return spec.proposer if ok and jax.process_count() == 1 else None

    @property
    def k(self) -> int:
        return self.spec.max_k

    medusa = property(lambda self: isinstance(self.proposer, MedusaProposer))
    model_draft = property(lambda self: isinstance(self.proposer, ModelDraftProposer))

    @property
    def own_kv(self) -> bool:
        """A draft model with a paged KV pool of its own (self-speculation uses the target's first layers')."""
        return self.model_draft and not self.proposer.shares_target_kv

    @property
    def searched(self) -> int:
        """The tail of a row's tokens the loop starts from: what prompt lookup searches (else: the last token)."""
        return self.proposer.max_history if isinstance(self.proposer, NgramProposer) else 1

    @property
    def history(self) -> int:
        """H, the history buffer's width: the tokens prompt lookup searches (the last max_history, at most
        max_model_len) plus what one loop appends, rounded up to 128: independent of the context length."""
        n = min(self.loops.max_model_len, self.searched) + self.num_steps * (self.k + 1)
        return -(-n // 128) * 128

    def _key(self, s: int, w: int) -> tuple:
        p, head = self.proposer, (self.num_steps, self.k, s, w, self.history)
        if self.medusa:
            return ("medusa_loop", *head, repr(p.heads[0]), self._tag)
        if self.model_draft:
            return ("draft_loop", *head, repr(p.runner.graphdef), self.own_kv, self._tag)
        return ("spec_loop", *head, p.max_n, p.min_n, p.max_history, self._tag)

    def _args(self, s: int, w: int):
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        shaped = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
        st = shaped(SamplingTensors.from_rows([{}] * s))
        r = self.runner
        hist = i32(s, self.history)
        kv = self._kv_in()
        args = (r.params, kv, hist, i32(s), i32(s), i32(s, w), i32(s), i32(s), i32(s, MAX_STOP_IDS), st)
        if self.model_draft:
            return (*args, shaped(self.proposer.runner.params))
        if not self.medusa:
            return args
        h = jax.ShapeDtypeStruct((s, r.cfg.hidden_size), r.dtype)
        return (*args, shaped(self.proposer.heads[1]), h, jax.ShapeDtypeStruct((s,), jnp.bool_))

    def _build(self):
        p = self.proposer
        if self.model_draft:
            drafter = ("model", p.runner.graphdef, 0 if self.own_kv else p.runner.cfg.num_layers)
        else:
            drafter = ("medusa", p.heads[0]) if self.medusa else ("ngram", p.max_n, p.min_n, p.max_history)
        return spec_loop_fn(self.runner, self.num_steps, self.k, drafter)

    def _kv_in(self):
        """The loop's KV argument: the target's pool, followed by the draft model's own layers if it has them (one
        donated list: two donated pools made XLA copy both into and out of the loop)."""
        kv = self.runner.kv_cache
        return [*kv, *self.proposer.runner.kv_cache] if self.own_kv else kv

    def _out_tree(self, key: tuple):
        """The loop's output structure (the runner's for a loop, but with the draft's own KV layers in the KV)."""
        return jax.tree.structure((0, 0, self._kv_in(), 0)) if self.own_kv else None

    # Before and after the scheduler --------------------------------------------------------------------------

    def plan(self) -> bool:
        """Whether this step is the device loop's: every running request is a loop-able decode row and nothing
        waits for a slot. Then the policy decides which rows draft, and no host drafts are made."""
        self._draft_on = None
        if self.proposer is None or not self.spec.active():
            return False
        sched, loops = self.scheduler, self.loops
        if sched.num_waiting and sched.num_running < loops.max_num_seqs:
            return False  # a waiting request could be admitted: the host is needed between tokens
        running = list(sched.running)
        if not running or len(running) > self.runner.decode_buckets[-1]:
            return False
        for r in running:
            if r.status is not RequestStatus.RUNNING or r.num_tokens - r.num_computed_tokens != 1:
                return False
            if loops.row_limit(r, 0) is None:
                return False
        self.spec.release_departed()
        for r in running:
            r.spec_token_ids = []
        ks = self.spec.policy.num_speculative_tokens([r.request_id for r in running], batch_size=len(running))
        self._draft_on = {r.request_id: k > 0 for r, k in zip(running, ks)}
        return True

    def run(self, out: SchedulerOutput) -> StepResult | None:
        """Runs the loop over this step's rows; the step's result for Scheduler.update, or None (run it another
        way)."""
        draft_on, self._draft_on = self._draft_on, None
        # No row drafts: prompt lookup leaves the step to the plain (chaining) decode loop; medusa keeps its loop,
        # which keeps each row's hidden state current for when the policy lets it draft again.
        if draft_on is None or not (any(draft_on.values()) or self.medusa):
            return None
        if any(len(sr.token_ids) != 1 or sr.num_draft or not sr.sample or sr.request_id not in draft_on
               for sr in out.scheduled):  # fmt: skip
            return None
        reqs = [sr.request for sr in out.scheduled]
        n_max = self.num_steps * (self.k + 1)
        limits = [min(n_max, r.remaining_tokens(self.loops.max_model_len)) for r in reqs]
        if min(limits) < 1 or not self.loops.reserve(reqs, limits):
            return None
        if self.own_kv:  # the draft's KV right below each row's last token (its loop keeps it so from there)
            self.proposer.catch_up_rows(self._rows(reqs))
        res = self.dispatch(reqs, limits, [draft_on[r.request_id] for r in reqs])
        rows = []
        c, policy = self.spec.counters, self.spec.policy
        for i, r in enumerate(reqs):
            n = int(res.counts[i])
            rows.append(RowResult([int(t) for t in res.tokens[:n, i]], None, n))
            for d, e in zip(res.drafted[:, i], res.emitted[:, i]):
                if d > 0 and e > 0:  # a pass with drafts: e - 1 of them were accepted (and emitted)
                    policy.observe(r.request_id, int(d), int(e) - 1)
                    self.spec.proposer.observe(r.request_id, int(d), int(e) - 1)  # as the host path tells it
                    c.passes, c.drafted, c.accepted, c.emitted = (
                        c.passes + 1,
                        c.drafted + int(d),
                        c.accepted + int(e) - 1,
                        c.emitted + int(e),
                    )
        self.spec.num_verify_steps += int(np.count_nonzero(res.emitted.any(axis=1)))
        return StepResult(out, rows)

    def dispatch(self, reqs: Sequence[Request], limits: Sequence[int], draft_on: Sequence[bool]) -> SpecLoopResult:
        """Runs one loop over `reqs` (running decode rows whose blocks cover num_tokens - 1 + limits[i] positions)
        and waits for its results."""
        r = self.runner
        n = len(reqs)
        s = next(b for b in r.decode_buckets if b >= n)
        w = r.width([req.block_ids for req in reqs])
        hist = np.zeros((s, self.history), np.int32)
        length = np.ones(s, np.int32)  # padding rows: one token at position 0, limit 0 (the null page only)
        offset = np.zeros(s, np.int32)
        searched = self.searched
        tables = np.zeros((s, w), np.int32)
        lim = np.zeros(s, np.int32)
        on = np.zeros(s, np.int32)
        stops = np.full((s, MAX_STOP_IDS), -1, np.int32)
        for i, req in enumerate(reqs):
            ids = req.all_token_ids
            tail = ids[-searched:]  # what prompt lookup searches: older tokens never matter
            hist[i, : len(tail)] = tail
            length[i], offset[i] = len(tail), len(ids) - len(tail)
            tables[i, : len(req.block_ids)] = req.block_ids
            lim[i], on[i] = limits[i], draft_on[i]
            p = req.sampling_params
            ids = (list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids)))[:MAX_STOP_IDS]
            stops[i, : len(ids)] = ids
        st = pad_sampling(sampling_tensors(reqs), s)
        key = self._key(s, w)
        exe = r.executable(key, self._build, lambda: self._args(s, w), self._out_tree(key))
        args = (hist, length, offset, tables, lim, on, stops, st)
        if self.medusa:
            args = (*args, self.proposer.heads[1], *self._hidden_in(reqs, s))
        if self.model_draft:
            args = (*args, self.proposer.runner.params)
        out_tok, stats, kv, routed = exe(r.params, self._kv_in(), *args)
        n_t = len(r.kv_cache)
        r.kv_cache = kv[:n_t] if self.own_kv else kv
        if self.own_kv:
            self.proposer.runner.kv_cache = kv[n_t:]
        r.count_routed(routed)
        self.num_loops += 1
        if self.model_draft:  # the draft's KV is right below each row's new last token, on its present table
            counts = np.asarray(stats[0])
            for i, req in enumerate(reqs):
                self.proposer.loop_done(req.request_id, req.num_tokens + int(counts[i]) - 1, req.block_ids)
        if self.medusa:
            stats, h, has_h = stats
            counts, has_h = np.asarray(stats[0]), np.asarray(has_h)
            done = [i for i in range(n) if has_h[i]]
            if done:
                ids, num = [reqs[i].request_id for i in done], [reqs[i].num_tokens + int(counts[i]) for i in done]
                self.proposer.record(ids, num, h[np.asarray(done)])
        tokens, stats = np.asarray(out_tok)[:, :n], np.asarray(stats)[:, :n]
        m = self.num_steps
        return SpecLoopResult(tokens, stats[0], stats[1 : 1 + m], stats[1 + m :])

    @staticmethod
    def _rows(reqs: Sequence[Request]) -> list[ProposalRow]:
        return [ProposalRow(r.request_id, r.all_token_ids, 0, block_table=r.block_ids) for r in reqs]

    def _hidden_in(self, reqs: Sequence[Request], s: int):
        """(h [s, D], has_h [s]): each row's recorded hidden state, where it is current (the host verify path or an
        earlier loop recorded it at the request's present token count)."""
        r, p = self.runner, self.proposer
        got = [p.current(req.request_id, req.num_tokens) for req in reqs]
        zero = jnp.zeros((r.cfg.hidden_size,), r.dtype)
        h = jnp.stack([zero if g is None else g.astype(zero.dtype) for g in got] + [zero] * (s - len(reqs)))
        return h, np.array([g is not None for g in got] + [False] * (s - len(reqs)))

    def warmup(self, widths: Sequence[int] | None = None, threads: int | None = None) -> int:
        """Compiles the loop for every decode bucket (at the given table widths) so nothing compiles while serving;
        returns how many were compiled or loaded."""
        if self.proposer is None:
            return 0
        r = self.runner
        cap = max(1, min(r.max_num_seqs, self.spec.policy.config.batch_threshold))  # no row drafts from there on
        todo = []
        for w in r.width_buckets if widths is None else widths:
            for s in [b for b in r.decode_buckets if b < 2 * cap]:  # up to the bucket holding cap
                key, args = self._key(s, w), self._args(s, w)
                if not r.has_executable(key) and r.load_from_disk(key, args, self._out_tree(key)) is None:
                    todo.append((key, args))
        threads = threads or max(1, (os.cpu_count() or 2) // 2)
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = {pool.submit(self._build().lower(*args).compile): (key, args) for key, args in todo}
            for fut in concurrent.futures.as_completed(futures):
                key, args = futures[fut]
                exe = fut.result()
                r.store(key, args, exe)
        return len(todo)
