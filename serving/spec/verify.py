"""The speculative step: propose -> one verify pass -> processed target probs + rejection_sample -> emitted tokens.

    before schedule   policy: k_r per running decode row (load + acceptance EMA, serving/spec/policy.py)
                      host proposer (n-gram, trained heads): Request.spec_token_ids = drafts (the heads: with
                      their q)  |  model proposer: k_r placeholders
    schedule          the scheduler trims drafts to its budget and takes blocks for them (ScheduledRequest.num_draft)
    after schedule    model proposer: drafts num_draft tokens on the rows' block tables, written into token_ids
    verify            one target pass (runner.forward): rows of 1 + num_draft tokens, logits at each
                      draft rows: min_tokens bans per position -> processed_target_probs -> rejection_sample
                      other rows (prefill ends, rows without drafts): the engine's own sampler
                      trained heads: each sampled row's hidden state at its last emitted token is kept for them
    after             emitted tokens trimmed at a stop string; policy and proposer observe; Scheduler.update
                      applies stop ids / max_tokens token by token, rolls back rejected drafts' blocks

Exactness: a row emits its accepted drafts and one token drawn by the rejection rule, so its tokens follow the
target's processed distribution exactly (serving/spec/rule.py); under greedy decoding they are the target's
argmax chain, the tokens plain decoding emits. Randomness: row r draws with row_keys(seed_r, tokens generated), so
a seeded request gives the same tokens run to run (the draws differ from plain decoding's: same distribution,
different stream).

Rows that speculation leaves alone (k = 0): penalties (they depend on every earlier token, drafts included),
top logprobs, and every row from `speculative_batch_threshold` running sequences on (the policy's load ramp).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.sampling import NEG_INF, SamplingTensors, pad_sampling
from serving.config import SpeculativeConfig
from serving.core.request import Request, RequestStatus
from serving.core.scheduler_output import RowResult, SchedulerOutput, StepResult
from serving.engine.output import OutputProcessor
from serving.engine.runner import RowInput
from serving.engine.sampler import MAX_BANNED, Sampler, has_penalties, logprob_entry, sampling_tensors
from serving.spec.policy import SpecPolicy, SpecPolicyConfig
from serving.spec.proposers import NgramProposer, ProposalRow, Proposer
from serving.spec.rule import processed_target_probs, rejection_sample, row_keys

_UNBOUNDED = 1 << 30  # batch threshold standing for "speculate at any batch size"


@dataclasses.dataclass
class SpecCounters:
    """Totals of one method: verify passes with drafts, draft tokens, accepted drafts, emitted tokens."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(
            passes=self.passes,
            drafted=self.drafted,
            accepted=self.accepted,
            emitted=self.emitted,
            acceptance_rate=self.accepted / self.drafted if self.drafted else 0.0,
            mean_emitted_per_pass=self.emitted / self.passes if self.passes else 0.0,
        )


def policy_config(max_k: int, batch_threshold: int, probe_every: int = 8) -> SpecPolicyConfig:
    """Tiers 1/3/5/7 up to max_k (max_k itself the top tier); threshold 0: no load ramp; a request whose
    acceptance fails even tier 1 drafts on every `probe_every`-th step only."""
    tiers = tuple(sorted({t for t in (1, 3, 5, 7) if t < max_k} | {max_k}))
    if batch_threshold == 0:
        return SpecPolicyConfig(batch_threshold=_UNBOUNDED, ramp_ratio=1.0, tiers=tiers, probe_every=probe_every)
    return SpecPolicyConfig(batch_threshold=batch_threshold, tiers=tiers, probe_every=probe_every)


class SpecDecoder:
    """Runs the speculative steps of one engine (module docstring).

    Args:
      scheduler / runner: the engine's (assignable: the engine keeps them current).
      sampler: the engine's sampler (rows without drafts, serving/engine/sampler.py).
      outputs: the engine's output processor (where a row's emitted tokens end on a stop string).
      proposer: drafts tokens (serving/spec/proposers.py, serving/spec/draft_model.py).
      max_k: num_speculative_tokens, the widest draft (the verify step's padded width).
      policy: the adaptive policy (default: tiers up to max_k, no load threshold).
    """

    def __init__(
        self,
        scheduler,
        runner,
        sampler: Sampler,
        outputs: OutputProcessor,
        proposer: Proposer,
        max_k: int,
        policy: SpecPolicy | None = None,
    ):
        self.scheduler, self.runner, self.sampler, self.outputs = scheduler, runner, sampler, outputs
        self.proposer = proposer
        self.max_k = max_k
        self.policy = policy or SpecPolicy(policy_config(max_k, 0))
        self.counters = SpecCounters()
        self.num_verify_steps = 0
        self._q: dict = {}  # request -> (draft_probs [n, k, V], its row) of its current drafts (sampling proposers)

    # Before and after the scheduler --------------------------------------------------------------------------

    def active(self) -> bool:
        """Whether the policy would draft at the current batch size (else decode loops may chain freely)."""
        return self.policy.load_factor(len(self.scheduler.running)) > 0.0

    def takes(self, out: SchedulerOutput) -> bool:
        """Whether this step is the SpecDecoder's: it has drafts, or a hidden-state proposer may draft from it."""
        return any(sr.num_draft for sr in out.scheduled) or (
            getattr(self.proposer, "needs_hidden", 0) and self.active()
        )

    def before_schedule(self) -> None:
        """Sets each running decode row's spec_token_ids: drafts (host proposer) or k placeholders."""
        self.release_departed()
        running = [r for r in self.scheduler.running if r.status is RequestStatus.RUNNING]
        for r in running:
            r.spec_token_ids = []  # last step's, if the scheduler did not reach the row
        rows = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and _may_speculate(r)]
        if not rows:
            return
        ks = self.policy.num_speculative_tokens([r.request_id for r in rows], batch_size=len(running))
        asks = [(r, k) for r, k in zip(rows, ks) if k > 0]
        if self.proposer.after_schedule:
            for r, k in asks:
                r.spec_token_ids = [0] * k
            return
        ask_rows = [ProposalRow(r.request_id, r.all_token_ids, k) for r, k in asks]
        if getattr(self.proposer, "samples", False):  # drafts drawn from q with each row's sampling parameters
            proposal = self.proposer.propose(ask_rows, sampling_tensors([r for r, _ in asks]))
        else:
            proposal = self.proposer.propose(ask_rows)
        self._q = {}
        for j, ((r, _), toks, n) in enumerate(zip(asks, proposal.draft_tokens, proposal.num_draft)):
            r.spec_token_ids = [int(t) for t in toks[:n]]
            if proposal.draft_probs is not None:
                self._q[r.request_id] = (proposal.draft_probs, j)

    def _fill_drafts(self, out: SchedulerOutput) -> None:
        """Model proposers: the real drafts of every row the scheduler kept drafts for."""
        rows = [sr for sr in out.scheduled if sr.num_draft]
        if not self.proposer.after_schedule or not rows:
            return
        asks = [ProposalRow(sr.request_id, sr.request.all_token_ids, sr.num_draft, None, sr.block_table) for sr in rows]
        proposal = self.proposer.propose(asks)
        for sr, toks, n in zip(rows, proposal.draft_tokens, proposal.num_draft):
            if n != sr.num_draft:
                raise RuntimeError(f"{self.proposer.name} proposer drafted {n} of {sr.num_draft} tokens")
            sr.token_ids[len(sr.token_ids) - sr.num_draft :] = [int(t) for t in toks[:n]]

    # The verify step -----------------------------------------------------------------------------------------

    def step(self, out: SchedulerOutput) -> StepResult:
        """Verifies this step's drafts in one target pass; returns the step's result for Scheduler.update."""
        self._fill_drafts(out)
        rows = [RowInput(sr.token_ids, sr.start_pos, sr.block_table, 1 + sr.num_draft) for sr in out.scheduled]
        logits = self.runner.forward(rows)  # [L, V]: row i's 1 + num_draft logits after those of rows < i
        first = np.cumsum([0] + [r.num_logits for r in rows])[:-1]
        result = self._sample_plain(out, logits, first)
        spec = [(i, sr) for i, sr in enumerate(out.scheduled) if sr.num_draft]
        tokens, n_emit = self._verify(logits, [(first[i], sr) for i, sr in spec])
        for j, (i, sr) in enumerate(spec):
            emitted = [int(t) for t in tokens[j, : n_emit[j]]]
            accepted = int(n_emit[j]) - 1
            self.policy.observe(sr.request_id, sr.num_draft, accepted)
            self.proposer.observe(sr.request_id, sr.num_draft, accepted)
            c = self.counters
            c.passes, c.drafted, c.accepted, c.emitted = (
                c.passes + 1,
                c.drafted + sr.num_draft,
                c.accepted + accepted,
                c.emitted + len(emitted),
            )
            result.rows[i].token_ids = emitted[: self.outputs.stop_prefix(sr.request, emitted)]
        if getattr(self.proposer, "needs_hidden", False):
            self._record_hidden(out, first, {sr.request_id: int(n) for (_, sr), n in zip(spec, n_emit)})
        self.num_verify_steps += 1
        return result

    def _record_hidden(self, out: SchedulerOutput, first: np.ndarray, n_emit: dict) -> None:
        """Hands the proposer each sampled row's hidden state at the position whose logits drew its last token."""
        rows = [(i, sr, n_emit.get(sr.request_id, 1)) for i, sr in enumerate(out.scheduled) if sr.sample]
        if rows:
            index = jnp.asarray([first[i] + n - 1 for i, _, n in rows], jnp.int32)
            hidden = self.runner.last_hidden[index]  # [n, D], on device
            self.proposer.record(
                [sr.request_id for _, sr, _ in rows], [sr.request.num_tokens + n for _, sr, n in rows], hidden
            )

    def _sample_plain(self, out: SchedulerOutput, logits, first: np.ndarray) -> StepResult:
        """Rows without drafts that sample: the engine's sampler on their last logit (penalties, logprobs, bans);
        the result's other rows are empty."""
        result = StepResult(out, [RowResult() for _ in out.scheduled])
        plain = [(i, sr) for i, sr in enumerate(out.scheduled) if sr.sample and not sr.num_draft]
        if not plain:
            return result
        reqs = [sr.request for _, sr in plain]
        tok, lp, top_ids, top_lp = self.sampler.sample(logits, reqs, [int(first[i]) for i, _ in plain])
        for j, (i, sr) in enumerate(plain):
            row = result.rows[i]
            row.token_ids = [int(tok[j])]
            if sr.request.sampling_params.logprobs is not None:
                row.logprobs = [logprob_entry(sr.request, tok[j], lp[j], top_ids[j], top_lp[j])]
        return result

    def _verify(self, logits, spec: Sequence[tuple[int, object]]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, k+1], num_emitted [B]) of the draft rows, from the logits starting at each row's offset."""
        if not spec:
            return np.zeros((0, self.max_k + 1), np.int32), np.zeros(0, np.int32)
        n = len(spec)
        b = 1 << (n - 1).bit_length()  # rows padded to a power of two: one compilation per bucket
        k1 = self.max_k + 1
        index = np.zeros((b, k1), np.int32)
        drafts = np.full((b, self.max_k), -1, np.int32)
        num_draft = np.zeros(b, np.int32)
        banned = np.full((b, k1, MAX_BANNED), -1, np.int32)
        for j, (off, sr) in enumerate(spec):
            d = sr.num_draft
            index[j] = off + np.minimum(np.arange(k1), d)
            drafts[j, :d] = sr.token_ids[len(sr.token_ids) - d :]
            num_draft[j] = d
            banned[j] = _banned_per_position(sr.request, k1)
        st = pad_sampling(sampling_tensors([sr.request for _, sr in spec]), b)
        tokens, n_emit = _verify_rows(logits, index, banned, st, drafts, num_draft, self._draft_probs(spec, b))
        return np.asarray(tokens)[:n], np.asarray(n_emit)[:n]

    def warmup(self) -> None:
        """Compiles the verify function for every (logits bucket, drafting-row bucket) a step can hand it, so
        nothing compiles while serving: rows b run in powers of two up to max_num_seqs, or up to the batch
        threshold's bucket when one is set (no row drafts from there on)."""
        r, k1 = self.runner, self.max_k + 1
        cap = max(1, min(r.max_num_seqs, self.policy.config.batch_threshold))
        rows = [1 << i for i in range((cap - 1).bit_length() + 1)]  # 1, 2, 4, ... up to the bucket holding cap
        q = getattr(self.proposer, "samples", False)
        for n in r.logit_buckets:
            logits = r.zero_logits(n)
            for b in rows:
                st = pad_sampling(sampling_tensors([]), b)
                args = (np.zeros((b, k1), np.int32), np.full((b, k1, MAX_BANNED), -1, np.int32), st)
                drafts, num = np.zeros((b, self.max_k), np.int32), np.zeros(b, np.int32)
                qs = [None] + ([jnp.zeros((b, self.max_k, r.cfg.vocab_size), jnp.float32)] if q else [])
                for q_bkv in qs:
                    jax.block_until_ready(_verify_rows(logits, *args, drafts, num, q_bkv))

    def _draft_probs(self, spec: Sequence[tuple[int, object]], b: int):
        """q [b, max_k, V] of the rows' drafts (sampling proposers), or None (q one-hot at each draft)."""
        got = [self._q.get(sr.request_id) for _, sr in spec]
        if not got or any(g is None for g in got):
            return None
        q = jnp.stack([g[0][g[1]] for g in got])  # [n, k, V]
        return jnp.pad(q, ((0, b - q.shape[0]), (0, self.max_k - q.shape[1]), (0, 0)))

    def release_departed(self) -> None:
        """Drops the policy's and the proposer's state of requests that left (finished or aborted)."""
        live = set(self.scheduler.requests)
        for rid in self.policy.tracked - live:
            self.policy.release(rid)
        for rid in getattr(self.proposer, "tracked", set()) - live:
            self.proposer.release(rid)

    def metrics(self) -> dict[str, dict[str, float]]:
        """Per method: passes, drafted, accepted, emitted, acceptance_rate, mean_emitted_per_pass."""
        return {self.proposer.name: self.counters.as_dict()}


def _may_speculate(req: Request) -> bool:
    p = req.sampling_params
    # A grammar masks one token at a time; a logit bias changes the target distribution the drafts are checked on.
    return not has_penalties(p) and p.logprobs is None and p.constraint is None and not p.logit_bias


def _banned_per_position(req: Request, k1: int) -> np.ndarray:
    """EOS and stop ids banned at each verify position j before min_tokens (the row's output then has j more)."""
    out = np.full((k1, MAX_BANNED), -1, np.int32)
    p = req.sampling_params
    ids = (list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids)))[:MAX_BANNED]
    for j in range(k1):
        if req.num_output_tokens + j < p.min_tokens and ids:
            out[j, : len(ids)] = ids
    return out


@functools.partial(jax.jit)
def _verify_rows(logits_lv, index_bk, banned_bkn, st: SamplingTensors, drafts_bk, num_draft_b, q_bkv=None):
    """Gathers each row's k+1 logits, bans ids per position, processes them as the sampler would, then accepts."""
    l_bkv = logits_lv[index_bk].astype(jnp.float32)  # [B, k+1, V]
    b, k1, v = l_bkv.shape
    hit = jnp.zeros((b, k1, v), bool)
    bi, ki = jnp.meshgrid(jnp.arange(b), jnp.arange(k1), indexing="ij")
    hit = hit.at[bi[..., None], ki[..., None], jnp.maximum(banned_bkn, 0)].max(banned_bkn >= 0)
    l_bkv = jnp.where(hit, NEG_INF, l_bkv)
    probs = processed_target_probs(l_bkv, st)
    keys = row_keys(st.seed, st.step)
    return rejection_sample(probs, q_bkv, drafts_bk, num_draft_b, keys)


def make_spec_decoder(
    spec: SpeculativeConfig, model, runner, scheduler, sampler: Sampler, outputs: OutputProcessor
) -> SpecDecoder | None:
    """The SpecDecoder `spec` asks for (None when speculation is off), over the engine's parts."""
    if spec.method is None:
        return None
    if spec.method == "ngram":
        proposer: Proposer = NgramProposer()
    elif spec.method == "medusa":
        from serving.spec.head_proposer import make_medusa_proposer

        proposer = make_medusa_proposer(runner, spec)
    else:
        from serving.spec.draft_model import make_model_proposer

        proposer = make_model_proposer(spec.method, runner, model, spec, model.dtype)
    policy = SpecPolicy(policy_config(spec.num_speculative_tokens, spec.speculative_batch_threshold))
    return SpecDecoder(scheduler, runner, sampler, outputs, proposer, spec.num_speculative_tokens, policy)
