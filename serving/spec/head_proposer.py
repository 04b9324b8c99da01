"""Trained-head proposer (speculative_method="medusa"): drafts from the hidden state the target already computed.

    verify / plain step   runner.forward -> logits [L, V] and runner.last_hidden [L, D] (the same pass)
    SpecDecoder.step      row r emitted n tokens: keep hidden[first_r + n - 1], the state whose logits drew its
                          last token t  ->  record(r, num_tokens after the step, h_r)
    next before_schedule  propose: heads(h_r) -> head i's processed distribution q_i (the row's temperature,
                          top-k/p, min-p; one-hot at the argmax for greedy rows) -> d_i ~ q_i, i < k
    verify                [t, d_0 .. d_{k-1}] in one target pass; rejection_sample with draft_probs = q

Head i predicts the token i + 1 beyond t (model/medusa.py), so the drafts continue t without another target pass.
q_i does not depend on the earlier drafts: a valid special case of the rejection rule's q_i(. | context, d_<i), so
output stays exactly the target's. A recorded state is used only while the request still has the token count it was
recorded at; a row without one (its first decode step, after a decode loop) gets no drafts that step, and the step
records one. While the proposer may draft (SpecDecoder.takes) every engine step goes through the SpecDecoder or
the on-device speculative loop (serving/spec/device_loop.py: the same heads and draw, `draw_drafts`, per loop
iteration; the loop carries h and records it here when it ends), so the hidden states are never lost to a plain
decode loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.medusa import MedusaHeads, head_logits, load_heads
from model.sampling import SamplingTensors, pad_sampling
from serving.engine.runner import ModelRunner
from serving.spec.proposers import Proposal, ProposalRow, Proposer, check_rows
from serving.spec.rule import processed_target_probs, row_keys

_DRAFT_STREAM = 7  # fold_in tag of the draft draws: independent of the verify step's (1) and its Gumbel draw (none)


class MedusaProposer(Proposer):
    """Drafts with trained heads on the target's last hidden state (module docstring).

    Args:
      heads: the trained heads (model/medusa.py).
      runner: the target's runner (its parameters hold the LM head the heads share; read at every call, so a
        weight swap is seen).
      max_k: num_speculative_tokens; at most the checkpoint's number of heads.
    """

    name = "medusa"
    needs_hidden = True  # SpecDecoder records the target's hidden states for it
    samples = True  # propose() takes the rows' SamplingTensors (drafts are drawn from q)

    def __init__(self, heads: MedusaHeads, runner: ModelRunner, max_k: int):
        if max_k > heads.cfg.num_heads:
            raise ValueError(
                f"num_speculative_tokens={max_k} exceeds the {heads.cfg.num_heads} heads of the speculative_model"
            )
        if heads.cfg.hidden_size != runner.cfg.hidden_size or heads.cfg.vocab_size != runner.cfg.vocab_size:
            raise ValueError(
                f"speculative_model heads ({heads.cfg}) do not fit the target (hidden_size {runner.cfg.hidden_size}, "
                f"vocab_size {runner.cfg.vocab_size})"
            )
        self._graph, self._state = nnx.split(heads)
        self._runner = runner
        self._hidden: dict[Any, tuple[jax.Array, int, int]] = {}  # request -> (batch [n, D], its row, num_tokens)

    def record(self, request_ids: Sequence[Any], num_tokens: Sequence[int], hidden_nd: jax.Array) -> None:
        """After a target pass: request_ids[j], then at num_tokens[j] tokens, continues from hidden_nd[j]."""
        for j, (rid, n) in enumerate(zip(request_ids, num_tokens)):
            self._hidden[rid] = (hidden_nd, j, int(n))

    def current(self, request_id: Any, num_tokens: int) -> jax.Array | None:
        """The request's recorded hidden state [D] if it is still at `num_tokens` tokens, else None."""
        got = self._hidden.get(request_id)
        return got[0][got[1]] if got is not None and got[2] == num_tokens else None

    @property
    def heads(self):
        """(graphdef, state) of the heads (the on-device loop takes them as arguments)."""
        return self._graph, self._state

    def propose(self, rows: Sequence[ProposalRow], st: SamplingTensors | None = None) -> Proposal:
        """Drafts for rows with a current hidden state; `st`: the rows' sampling parameters (None: greedy)."""
        k_max = check_rows(rows)
        draft = np.full((len(rows), k_max), -1, np.int32)
        num = np.zeros(len(rows), np.int32)
        live = [
            (i, got)
            for i, r in enumerate(rows)
            if r.k > 0 and (got := self.current(r.request_id, len(r.token_ids))) is not None
        ]
        if not live:
            return Proposal(draft, num, None)
        b = 1 << (len(live) - 1).bit_length()  # rows padded to a power of two: one compilation per bucket
        pieces = [h[None] for _, h in live]
        h = jnp.concatenate(pieces + [jnp.zeros((b - len(live), pieces[0].shape[-1]), pieces[0].dtype)])
        st = SamplingTensors.from_rows([{}] * len(rows)) if st is None else st
        st_live = pad_sampling(jax.tree.map(lambda a: np.asarray(a)[[i for i, _ in live]], st), b)
        # Only the k_max heads asked for run (each costs one pass through the LM head): one compilation per tier.
        tokens, q = _draft(self._graph, self._state, self._runner.graphdef, self._runner.params, h, st_live, k_max)
        tokens = np.asarray(tokens)
        probs = jnp.zeros((len(rows), k_max, q.shape[-1]), jnp.float32)
        probs = probs.at[np.asarray([i for i, _ in live])].set(q[: len(live)])
        for j, (i, _) in enumerate(live):
            draft[i, : rows[i].k] = tokens[j, : rows[i].k]
            num[i] = rows[i].k
        return Proposal(draft, num, probs)

    def release(self, request_id: Any) -> None:
        self._hidden.pop(request_id, None)

    @property
    def tracked(self) -> set:
        return set(self._hidden)


def draw_drafts(heads: MedusaHeads, target, h_bd, st: SamplingTensors, num_heads: int):
    """(drafts [B, k], q [B, k, V]) of the first k = num_heads heads: head i's processed distribution and a draw
    from it (its argmax for greedy rows), keyed by row_keys(seed, step) folded with _DRAFT_STREAM."""
    logits = head_logits(heads, target, h_bd, num_heads)  # [B, k, V]

    def sampled(_):
        q = processed_target_probs(logits, st)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, _DRAFT_STREAM))(row_keys(st.seed, st.step))
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, q.shape[1:], jnp.float32))(keys)  # [B, H, V]
        return jnp.argmax(jnp.log(q) + gumbel, axis=-1).astype(jnp.int32), q  # a draw (one-hot rows: the argmax)

    def greedy(_):  # an all-greedy batch: no vocabulary sort, no Gumbel noise (q one-hot at the argmax)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, jax.nn.one_hot(tokens, logits.shape[-1], dtype=jnp.float32)

    return jax.lax.cond(jnp.any(st.temperature > 0), sampled, greedy, None)


@functools.partial(jax.jit, static_argnums=(0, 2, 6))
def _draft(heads_graph, heads_state, target_graph, target_params, h_bd, st: SamplingTensors, num_heads: int):
    heads, target = nnx.merge(heads_graph, heads_state), nnx.merge(target_graph, target_params)
    return draw_drafts(heads, target, h_bd, st, num_heads)


def make_medusa_proposer(runner: ModelRunner, spec) -> MedusaProposer:
    """The proposer of speculative_method "medusa": heads loaded from `spec.speculative_model`."""
    heads, _ = load_heads(spec.speculative_model)
    return MedusaProposer(heads, runner, spec.num_speculative_tokens)
