"""model/sampling.py on random logits: greedy, top-k / top-p / min-p supports, temperature frequencies, penalties,
banned ids, logprobs and per-row seeds.

Supports are checked by drawing one row many times with different seeds (a batch of identical rows) and comparing
the set of tokens seen with the set the definition keeps; logits are drawn so every kept token has probability
well above 1 / num_draws, so a missing token means a bug rather than bad luck.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.sampling import (
    TOP_CANDIDATES,
    SamplingTensors,
    _filter,
    apply_penalties,
    filter_logits,
    filter_logits_fast,
    sample,
)

V = 24  # vocabulary of the toy rows
DRAWS = 4000

_sample = jax.jit(sample, static_argnames=("num_logprobs",))


def _st(b: int, **fields) -> SamplingTensors:
    """b rows with the given fields (scalars broadcast; arrays per row)."""
    rows = [{k: (v[i] if isinstance(v, (list, np.ndarray)) else v) for k, v in fields.items()} for i in range(b)]
    return SamplingTensors.from_rows(rows)


def _logits(seed: int, b: int = 1, v: int = V, scale: float = 1.5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((b, v)) * scale).astype(np.float32)


def _draws(row_v: np.ndarray, n: int = DRAWS, **fields) -> np.ndarray:
    """n tokens drawn from one row of logits, each with its own seed."""
    logits = np.broadcast_to(row_v, (n, row_v.shape[-1]))
    tok, *_ = _sample(jnp.asarray(logits), _st(n, seed=np.arange(n), **fields))
    return np.asarray(tok)


def _probs(row_v: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = row_v / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def _top_p_set(probs: np.ndarray, p: float) -> set[int]:
    """Smallest most-likely prefix whose mass reaches p (the token crossing p included)."""
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    return set(order[mass_before < p].tolist())


# Greedy ------------------------------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = _logits(0, b=64, v=1000)
    tok, lp, _, _ = _sample(jnp.asarray(logits), _st(64, temperature=0.0, seed=np.arange(64)))
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    ref_lp = jax.nn.log_softmax(logits, axis=-1)[np.arange(64), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=1e-6)


def test_greedy_ignores_filters_and_seed():
    logits = _logits(1, b=8, v=200)
    tok, *_ = _sample(
        jnp.asarray(logits), _st(8, temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=np.arange(8) * 7919)
    )
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))


def test_top_k_1_is_greedy():
    logits = _logits(2, b=1, v=500)[0]
    toks = _draws(logits, n=512, temperature=1.3, top_k=1)
    assert set(toks.tolist()) == {int(logits.argmax())}


# Supports of the filters -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 5, 11])
def test_top_k_support(k):
    logits = _logits(10 + k, scale=0.7)[0]
    expected = set(np.argsort(-logits)[:k].tolist())
    assert set(_draws(logits, temperature=1.0, top_k=k).tolist()) == expected


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_support(p):
    logits = _logits(20, scale=0.8)[0]
    expected = _top_p_set(_probs(logits), p)
    assert set(_draws(logits, temperature=1.0, top_p=p).tolist()) == expected


def test_top_p_one_keeps_everything():
    logits = _logits(21, scale=0.3)[0]
    assert set(_draws(logits, temperature=1.0, top_p=1.0).tolist()) == set(range(V))


def test_top_p_after_temperature():
    logits = _logits(22, scale=0.8)[0]
    t = 0.5
    expected = _top_p_set(_probs(logits, t), 0.8)
    assert expected != _top_p_set(_probs(logits), 0.8)  # the test distinguishes the two orders
    assert set(_draws(logits, temperature=t, top_p=0.8).tolist()) == expected


def test_top_k_then_top_p_renormalised():
    # probs 0.4 0.3 0.2 0.1: top-k 3 leaves (0.44, 0.33, 0.22); top-p 0.75 on that keeps two tokens (HF / vLLM
    # order). Top-p on the unfiltered distribution would keep three (mass before the third is 0.7 < 0.75).
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    assert set(_draws(logits, n=2000, temperature=1.0, top_k=3, top_p=0.75).tolist()) == {0, 1}


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p_support(min_p):
    logits = _logits(30, scale=0.8)[0]
    probs = _probs(logits)
    expected = set(np.flatnonzero(probs >= min_p * probs.max()).tolist())
    assert set(_draws(logits, temperature=1.0, min_p=min_p).tolist()) == expected


def test_filter_logits_matches_definitions_exactly():
    """filter_logits keeps exactly the intersection of the three sets, row by row."""
    logits = _logits(40, b=6, v=64, scale=2.0)
    top_k = [0, 5, 20, 64, 3, 10]
    top_p = [0.5, 1.0, 0.9, 0.7, 1.0, 0.95]
    min_p = [0.0, 0.0, 0.1, 0.0, 0.3, 0.02]
    temp = [1.0, 0.7, 1.2, 0.9, 1.0, 2.0]
    out = np.asarray(
        filter_logits(jnp.asarray(logits), _st(6, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temp))
    )
    for b in range(6):
        probs = _probs(logits[b], temp[b])
        keep = set(range(64))
        if 0 < top_k[b] < 64:
            keep &= set(np.argsort(-probs)[: top_k[b]].tolist())
        kept_probs = np.where(np.isin(np.arange(64), list(keep)), probs, 0.0)
        keep &= _top_p_set(kept_probs / kept_probs.sum(), top_p[b]) if top_p[b] < 1 else keep
        if min_p[b] > 0:
            keep &= set(np.flatnonzero(probs >= min_p[b] * probs.max()).tolist())
        assert set(np.flatnonzero(np.isfinite(out[b])).tolist()) == keep, b
        np.testing.assert_allclose(out[b][np.isfinite(out[b])], (logits[b] / temp[b])[np.isfinite(out[b])], rtol=1e-6)


def test_candidate_filter_equals_full_sort():
    """The top-TOP_CANDIDATES path keeps exactly the full sort's support (and values), row by row: top-k <= C
    (with top-p and min-p inside), top-p alone whose mass the candidates hold; rows it cannot decide (top-k > C,
    top-p beyond the candidates' mass) are flagged, and a batch holding one takes the full sort."""
    v = 4096
    rng = np.random.default_rng(7)
    peaked = (rng.standard_normal((8, v)) * 4.0).astype(np.float32)  # most mass in a few dozen tokens
    top_k = [5, 1, 256, 40, 0, 0, 0, 17]
    top_p = [1.0, 1.0, 0.9, 0.8, 0.9, 0.5, 1.0, 0.95]
    min_p = [0.0, 0.0, 0.0, 0.05, 0.0, 0.01, 0.0, 0.0]
    st = _st(8, top_k=top_k, top_p=top_p, min_p=min_p, temperature=[1.0, 0.8, 1.0, 1.3, 0.7, 1.0, 1.0, 0.9])
    fast, exact = _filter(jnp.asarray(peaked), st, TOP_CANDIDATES)
    full = np.asarray(filter_logits(jnp.asarray(peaked), st))
    assert np.asarray(exact).all()
    np.testing.assert_array_equal(np.isfinite(np.asarray(fast)), np.isfinite(full))
    np.testing.assert_array_equal(np.asarray(fast), full)
    assert (np.isfinite(full).sum(-1) < v).sum() == 7  # every row but the unfiltered one really filters
    # Flat logits: top-p 0.99 needs far more than C tokens, and top-k 1000 > C; the fast path must refuse them.
    flat = (rng.standard_normal((3, v)) * 0.1).astype(np.float32)
    st = _st(3, top_k=[0, 1000, 8], top_p=[0.99, 1.0, 1.0], temperature=1.0)
    _, exact = _filter(jnp.asarray(flat), st, TOP_CANDIDATES)
    assert np.asarray(exact).tolist() == [False, False, True]
    got = np.asarray(jax.jit(filter_logits_fast)(jnp.asarray(flat), st))
    np.testing.assert_array_equal(got, np.asarray(filter_logits(jnp.asarray(flat), st)))
    assert np.isfinite(got[0]).sum() > TOP_CANDIDATES and np.isfinite(got[1]).sum() == 1000


# Frequencies ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_temperature_frequencies_match_softmax(temperature):
    logits = _logits(50, v=8, scale=1.0)[0]
    n = 20000
    counts = np.bincount(_draws(logits, n=n, temperature=temperature), minlength=8)
    expected = _probs(logits, temperature) * n
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 24.3, (chi2, counts, expected)  # chi-square, 7 degrees of freedom, p = 0.001


def test_top_k_frequencies_renormalised():
    logits = _logits(51, v=10, scale=1.0)[0]
    n = 20000
    counts = np.bincount(_draws(logits, n=n, temperature=1.0, top_k=4), minlength=10)
    top = np.argsort(-logits)[:4]
    p = _probs(logits[top])
    chi2 = float(np.sum((counts[top] - p * n) ** 2 / (p * n)))
    assert chi2 < 16.3 and counts.sum() == counts[top].sum(), chi2  # 3 degrees of freedom, p = 0.001


# Penalties --------------------------------------------------------------------------------------------------------


def test_penalties_match_openai_and_hf():
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]], np.float32)
    output_ids = np.array([[0, 0, 1, -1]], np.int32)  # token 0 twice, token 1 once
    prompt_ids = np.array([[3, 0, -1, -1]], np.int32)  # token 3 only in the prompt
    st = _st(1, repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5)
    got = np.asarray(apply_penalties(jnp.asarray(logits), st, jnp.asarray(output_ids), jnp.asarray(prompt_ids)))
    expected = logits.copy()
    # HF repetition penalty on every token seen in prompt or output: positive logits divided, negative multiplied.
    for t in (0, 1, 3):
        expected[0, t] = expected[0, t] / 1.5 if expected[0, t] > 0 else expected[0, t] * 1.5
    # OpenAI: logit - count * frequency_penalty - (count > 0) * presence_penalty, over generated tokens only.
    expected[0, 0] -= 2 * 0.5 + 0.25
    expected[0, 1] -= 1 * 0.5 + 0.25
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_neutral_penalties_are_identity_and_padding_is_ignored():
    logits = _logits(60, b=2, v=16)
    ids = np.array([[-1, -1], [5, -1]], np.int32)
    got = apply_penalties(jnp.asarray(logits), _st(2), jnp.asarray(ids), jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got), logits)


def test_penalties_steer_greedy_choice():
    logits = np.array([[3.0, 2.9, 0.0, 0.0]], np.float32)
    out_ids = np.array([[0, -1]], np.int32)
    tok, *_ = _sample(jnp.asarray(logits), _st(1, temperature=0.0, presence_penalty=0.5), jnp.asarray(out_ids), None)
    assert int(tok[0]) == 1


# Banned ids, logprobs, seeds --------------------------------------------------------------------------------------


def test_banned_ids_never_sampled():
    logits = _logits(70, v=12, scale=0.5)[0]
    logits[3] = 10.0  # the banned token dominates
    n = 2000
    banned = np.tile(np.array([[3, 7, -1]], np.int32), (n, 1))
    for fields in (
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=1.0, top_k=1),
        dict(temperature=2.0, top_p=0.9),
    ):
        st = _st(n, seed=np.arange(n), **fields)
        tok, *_ = _sample(jnp.asarray(np.broadcast_to(logits, (n, 12))), st, None, None, jnp.asarray(banned))
        seen = set(np.asarray(tok).tolist())
        assert not seen & {3, 7}, fields


def test_logprobs_are_raw_model_logprobs():
    logits = _logits(80, b=3, v=50, scale=2.0)
    output_ids = np.array([[1, -1], [2, 2], [-1, -1]], np.int32)
    st = _st(3, temperature=[0.0, 0.8, 1.5], top_k=[0, 5, 0], seed=[1, 2, 3], frequency_penalty=0.7)
    tok, lp, top_ids, top_lp = _sample(jnp.asarray(logits), st, jnp.asarray(output_ids), None, num_logprobs=5)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    tok = np.asarray(tok)
    np.testing.assert_allclose(np.asarray(lp), raw[np.arange(3), tok], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-raw, axis=-1)[:, :5])
    np.testing.assert_allclose(np.asarray(top_lp), -np.sort(-raw, axis=-1)[:, :5], atol=1e-6)


def test_seeded_row_independent_of_batch():
    """A row's draw depends only on its logits, parameters, seed and step, not on its batch or position."""
    rng = np.random.default_rng(90)
    target = _logits(91, v=300)[0]
    fields = dict(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = []
    for step in range(20):
        tok, *_ = _sample(jnp.asarray(target[None]), _st(1, step=step, **fields))
        alone.append(int(tok[0]))
    assert len(set(alone)) > 1  # the step changes the draw
    for b, pos in ((8, 0), (8, 5), (32, 31)):
        logits = _logits(92 + b + pos, b=b, v=300)
        logits[pos] = target
        seeds = rng.integers(0, 2**31, b)
        seeds[pos] = 1234
        temps = rng.choice([0.0, 0.5, 1.0, 0.8], b)
        temps[pos] = 0.8
        top_k, top_p = np.full(b, 0), np.full(b, 1.0)
        top_k[pos], top_p[pos] = 50, 0.9
        batch = []
        for step in range(20):
            st = _st(b, temperature=temps, top_k=top_k, top_p=top_p, seed=seeds, step=np.full(b, step))
            tok, *_ = _sample(jnp.asarray(logits), st)
            batch.append(int(tok[pos]))
        assert batch == alone, (b, pos)


def test_different_seeds_differ():
    logits = _logits(95, v=1000, scale=0.1)[0]
    toks = _draws(logits, n=64, temperature=1.0)
    assert len(set(toks.tolist())) > 32
