"""serving/spec/rule.py: the rejection sampler's output is exactly the target's distribution.

The harness generates token streams from a toy Markov "language model" (target P[prev] and draft Q[prev], V x V)
by repeated speculative steps: draft k tokens from Q, build the target's k+1 conditionals from the drafts (what a
verify pass computes), call the sampler, append the emitted tokens. The first 8 tokens of every stream must then be
distributed as the target's own chain: the joint of tokens 1..3 and the marginal at position k+1 (which the bonus
and residual tokens of different rows reach through different paths) are chi-square tested over 1e5 streams, one
row each (so num_draft differs per row in the ragged cases). Arrays are padded to k_max = 7 drafts as the engine
pads its rows, and num_draft = k (or uniform in [0, k]) says how many count, so every case shares one compiled
program. The same harness must reject two deliberately wrong rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.sampling import SamplingTensors, sample
from serving.spec.rule import (
    expected_tokens_per_pass,
    processed_target_probs,
    rejection_sample,
    row_keys,
)

N = 100_000  # streams per case
V = 6
P_MIN = 0.01


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of observed `counts` against `probs` (cells with expected < 5 merged)."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if np.any(counts[expected == 0] > 0):
        return 0.0  # a token the target gives no mass was emitted
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    df = int(keep.sum()) - 1
    return float(jax.scipy.stats.chi2.sf(stat, df))


def _wrong_rules():
    """Two wrong samplers, written out in full (so they share nothing with the rule under test but its layout)."""

    def finish(target_probs, tokens_k, n_acc, dist_fn, key):
        b, k1, v = target_probs.shape
        rows = jnp.arange(b)
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(rows)
        g = jax.vmap(lambda kk: jax.random.gumbel(kk, (v,)))(keys)
        last = jnp.argmax(jnp.log(dist_fn(rows, n_acc)) + g, axis=-1).astype(jnp.int32)
        pos = jnp.arange(k1)[None]
        padded = jnp.concatenate([tokens_k, jnp.full((b, 1), -1, jnp.int32)], 1)
        out = jnp.where(pos < n_acc[:, None], padded, -1)
        return jnp.where(pos == n_acc[:, None], last[:, None], out), n_acc + 1

    def make(accept_ratio, residual):
        def rule(target_probs, draft_probs, draft_tokens, num_draft, key):
            b, k1, v = target_probs.shape
            k = k1 - 1
            u = jax.random.uniform(jax.random.fold_in(key, 7), (b, k))
            p_x = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], -1)[..., 0]
            q_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
            ok = (u < accept_ratio(p_x, q_x)) & (jnp.arange(k)[None] < num_draft[:, None])
            n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), -1), -1).astype(jnp.int32)

            def dist(rows, n):
                p = target_probs[rows, n]
                q = draft_probs[rows, jnp.minimum(n, k - 1)]
                res = residual(p, q)
                return jnp.where((n < num_draft)[:, None] & (res.sum(-1, keepdims=True) > 1e-6), res, p)

            return finish(target_probs, draft_tokens, n_acc, dist, key)

        return rule

    q_over_p = make(lambda p, q: jnp.minimum(1.0, q / jnp.maximum(p, 1e-30)), lambda p, q: jnp.maximum(p - q, 0.0))
    resample_p = make(lambda p, q: jnp.minimum(1.0, p / jnp.maximum(q, 1e-30)), lambda p, q: p)
    return {"accept_min_1_q_over_p": q_over_p, "resample_from_p_not_residual": resample_p}


K_MAX = 7  # arrays are padded to k_max drafts, as the engine pads its rows; num_draft <= k says how many count
STEPS = K_MAX + 1


def _streams(P, Q, key, *, sampler=None, k, deterministic, fixed_k):
    """N token streams of >= STEPS tokens each, from context token 0, by speculative steps (one row per stream).

    Q's row is the draft distribution given the previous token; `deterministic` drafts argmax Q (q one-hot, passed
    to the sampler as draft_probs=None). num_draft is k, or uniform in [0, k] per row and step unless `fixed_k`.
    One compiled program per (sampler, deterministic): k and fixed_k are traced.
    """
    return _streams_jit(P, Q, key, jnp.int32(k), jnp.bool_(fixed_k), sampler=sampler or rejection_sample,
                        deterministic=deterministic)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("sampler", "deterministic"))
def _streams_jit(P, Q, key, k_case, fixed_k, *, sampler, deterministic, n=N, k=K_MAX, steps=STEPS):
    rows = jnp.arange(n)
    width = steps + k + 1

    def draft(carry, i):
        prev, k_draft = carry
        q = Q[prev]  # [n, V]
        if deterministic:
            tok = jnp.argmax(q, -1).astype(jnp.int32)
        else:
            tok = jax.random.categorical(jax.random.fold_in(k_draft, i), jnp.log(q), axis=-1).astype(jnp.int32)
        return (tok, k_draft), (tok, q)

    def step(s, state):
        buf, pos, last = state
        k_draft, k_nd, k_acc = jax.random.split(jax.random.fold_in(key, s), 3)
        _, (toks, qs) = jax.lax.scan(draft, (last, k_draft), jnp.arange(k))  # [k, n], [k, n, V]
        draft_tokens = toks.T  # [n, k]
        ctx = jnp.concatenate([last[:, None], draft_tokens], axis=1)  # [n, k+1]: token before each query
        target = P[ctx]  # [n, k+1, V]
        draft_probs = None if deterministic else jnp.swapaxes(qs, 0, 1)
        nd = jnp.where(fixed_k, k_case, jax.random.randint(k_nd, (n,), 0, k_case + 1, jnp.int32))
        tokens, ne = sampler(target, draft_probs, draft_tokens, nd, k_acc)
        cols = jnp.minimum(pos[:, None] + jnp.arange(k + 1)[None], width - 1)  # [n, k+1]
        keep = jnp.arange(k + 1)[None] < ne[:, None]
        buf = buf.at[rows[:, None], cols].set(jnp.where(keep, tokens, buf[rows[:, None], cols]))
        return buf, pos + ne, tokens[rows, ne - 1]

    init = (jnp.full((n, width), -1, jnp.int32), jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32))
    buf, _, _ = jax.lax.fori_loop(0, steps, step, init)
    return buf[:, :steps]


def _chain_pvalues(P: np.ndarray, streams: np.ndarray, k: int) -> dict[str, float]:
    """p-values of the joint of tokens 1..3 and the marginal at position k+1 against the target chain from 0."""
    v = P.shape[0]
    joint = np.einsum("a,ab,bc->abc", P[0], P, P)
    counts = np.bincount(streams[:, 0] * v * v + streams[:, 1] * v + streams[:, 2], minlength=v**3)
    out = {"joint_1_3": _chi2_pvalue(counts, joint)}
    j = k + 1
    if j > 3:
        marg = np.linalg.matrix_power(P.astype(np.float64), j)[0]
        out[f"marginal_{j}"] = _chi2_pvalue(np.bincount(streams[:, j - 1], minlength=v), marg)
    return out


def _rand_chain(rng, v=V, alpha=1.0) -> np.ndarray:
    return rng.dirichlet(np.full(v, alpha), size=v).astype(np.float32)


def _processed_chain(rng) -> np.ndarray:
    """A target chain whose rows went through temperature + top-k + top-p + min-p (some rows mix them)."""
    logits = rng.standard_normal((V, V)).astype(np.float32) * 2
    st = SamplingTensors.from_rows(
        [
            dict(temperature=0.7, top_k=4, top_p=0.85, min_p=0.0) if i % 2 else dict(temperature=1.3, min_p=0.1)
            for i in range(V)
        ]  # fmt: skip
    )
    return np.asarray(processed_target_probs(jnp.asarray(logits), st))


def _cases():
    rng = np.random.default_rng(1234)
    disjoint_p = np.zeros((V, V), np.float32)
    disjoint_p[:, :3] = rng.dirichlet(np.ones(3), size=V)
    disjoint_q = np.zeros((V, V), np.float32)
    disjoint_q[:, 3:] = rng.dirichlet(np.ones(3), size=V)
    partial_q = _rand_chain(rng) * (rng.random((V, V)) < 0.5)  # zeros where the target has mass
    partial_q[:, 0] += 0.05
    partial_q /= partial_q.sum(1, keepdims=True)
    same = _rand_chain(rng)
    return {
        # name: (P, Q, k, deterministic, fixed_k)
        "dense_k1": (_rand_chain(rng), _rand_chain(rng), 1, False, True),
        "dense_k3_ragged": (_rand_chain(rng, alpha=0.5), _rand_chain(rng), 3, False, False),
        "disjoint_supports_k2": (disjoint_p, disjoint_q, 2, False, True),
        "processed_target_k5": (_processed_chain(rng), _rand_chain(rng), 5, False, False),
        "partial_q_k4": (_rand_chain(rng), partial_q.astype(np.float32), 4, False, True),
        "onehot_draft_k7_ragged": (_rand_chain(rng), _rand_chain(rng), 7, True, False),
        "q_equals_p_k6": (same, same, 6, False, True),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_distribution_identity(name):
    P, Q, k, det, fixed = CASES[name]
    streams = np.asarray(_streams(P, Q, jax.random.key(7), k=k, deterministic=det, fixed_k=fixed))
    assert streams.min() >= 0
    pvals = _chain_pvalues(P, streams, k)
    assert min(pvals.values()) > P_MIN, pvals


@pytest.mark.parametrize("wrong", sorted(_wrong_rules()))
def test_harness_rejects_wrong_rules(wrong):
    """The same harness and threshold fail a sampler that breaks the rule (a test that cannot fail proves nothing)."""
    P, Q, k, _, _ = CASES["dense_k3_ragged"]
    sampler = _wrong_rules()[wrong]
    streams = np.asarray(_streams(P, Q, jax.random.key(7), sampler=sampler, k=k, deterministic=False, fixed_k=False))
    pvals = _chain_pvalues(P, streams, k)
    assert min(pvals.values()) < P_MIN, pvals
    # And the harness passes the same wrong layout with the right rule plugged in (it is the rule that fails).
    right = np.asarray(_streams(P, Q, jax.random.key(7), k=k, deterministic=False, fixed_k=False))
    assert min(_chain_pvalues(P, right, k).values()) > P_MIN


def test_greedy_is_the_argmax_chain():
    """One-hot targets: every stream is exactly the target's argmax chain, whatever the draft proposes."""
    rng = np.random.default_rng(3)
    nxt = rng.permutation(V)
    P = np.eye(V, dtype=np.float32)[nxt]  # greedy target: next token = nxt[prev]
    Q = _rand_chain(rng)
    Q[np.arange(V), nxt] += 0.5  # the draft often agrees
    Q /= Q.sum(1, keepdims=True)
    for det in (False, True):
        streams = np.asarray(_streams(P, Q, jax.random.key(0), k=4, deterministic=det, fixed_k=False))
        chain = [0]
        for _ in range(STEPS):
            chain.append(int(nxt[chain[-1]]))
        np.testing.assert_array_equal(streams, np.broadcast_to(np.array(chain[1:]), streams.shape))


# Expected tokens per pass ------------------------------------------------------------------------------------------


def test_expected_tokens_formula_over_k():
    """p = [a, 1-a, 0, 0], q = [a, 0, 1-a, 0] at every position: each draft is accepted with probability
    sum min(p, q) = a independently, so the mean emitted per pass is (1 - a^(k+1)) / (1 - a) and the count is
    truncated-geometric."""
    k_max, n = 7, 40_000
    means = {}
    for a in (0.5, 0.8):
        p = np.array([a, 1 - a, 0, 0], np.float32)
        q = np.array([a, 0, 1 - a, 0], np.float32)
        k_row = np.repeat(np.arange(1, k_max + 1, dtype=np.int32), n)  # n rows per k, one call
        key_d, key_s = jax.random.split(jax.random.key(int(100 * a)))
        drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q)), shape=(k_row.size, k_max)).astype(jnp.int32)
        tp = jnp.broadcast_to(jnp.asarray(p), (k_row.size, k_max + 1, 4))
        dp = jnp.broadcast_to(jnp.asarray(q), (k_row.size, k_max, 4))
        _, ne = rejection_sample(tp, dp, drafts, jnp.asarray(k_row), key_s)
        ne = np.asarray(ne)
        for k in range(1, k_max + 1):
            got = ne[k_row == k]
            expected = expected_tokens_per_pass(a, k)
            assert abs(got.mean() - expected) < 5 * got.std() / np.sqrt(n), (a, k, got.mean(), expected)
            pmf = np.array([a ** (m - 1) * (1 - a) for m in range(1, k + 1)] + [a**k])
            assert _chi2_pvalue(np.bincount(got, minlength=k + 2)[1:], pmf) > P_MIN, (a, k)
            means[(a, k)] = got.mean()
    assert means[(0.8, 7)] > means[(0.8, 1)] > means[(0.5, 1)]


def test_expected_tokens_per_pass_values():
    assert expected_tokens_per_pass(0.0, 5) == 1.0
    assert expected_tokens_per_pass(1.0, 5) == 6.0
    assert abs(expected_tokens_per_pass(0.81, 4) - (1 - 0.81**5) / 0.19) < 1e-12
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens_per_pass(1.5, 3)


# Seeds, shapes, edge cases -----------------------------------------------------------------------------------------


def _toy_batch(b=5, k=3, v=V, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(v), (b, k + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(v), (b, k)).astype(np.float32)
    x = rng.integers(0, v, (b, k)).astype(np.int32)
    nd = rng.integers(0, k + 1, b).astype(np.int32)
    return p, q, x, nd


def test_per_row_keys_do_not_depend_on_the_batch():
    p, q, x, nd = _toy_batch(b=6)
    seeds = np.arange(10, 16, dtype=np.uint32)
    steps = np.arange(6, dtype=np.int32) * 3
    tok, ne = rejection_sample(p, q, x, nd, row_keys(seeds, steps))
    for sub in ([2], [5, 0, 3]):
        t2, n2 = rejection_sample(p[sub], q[sub], x[sub], nd[sub], row_keys(seeds[sub], steps[sub]))
        np.testing.assert_array_equal(np.asarray(t2), np.asarray(tok)[sub])
        np.testing.assert_array_equal(np.asarray(n2), np.asarray(ne)[sub])
    again, _ = rejection_sample(p, q, x, nd, row_keys(seeds, steps))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(tok))
    other, _ = rejection_sample(p, q, x, nd, row_keys(seeds + 100, steps))
    assert not np.array_equal(np.asarray(other), np.asarray(tok))


def test_plain_row_draws_what_the_sampler_draws():
    """num_draft = 0 with the same (seed, step) keys gives model.sampling.sample's token (same Gumbel noise)."""
    b, v = 64, 50
    logits = np.random.default_rng(5).standard_normal((b, v)).astype(np.float32) * 2
    st = SamplingTensors.from_rows([dict(temperature=0.9, top_k=20, top_p=0.9, seed=s, step=3) for s in range(b)])
    want, *_ = sample(jnp.asarray(logits), st)
    probs = processed_target_probs(jnp.asarray(logits)[:, None], st)  # [B, 1, V]
    got, ne = rejection_sample(
        probs, jnp.zeros((b, 0, v)), jnp.zeros((b, 0), jnp.int32), jnp.zeros(b, jnp.int32), row_keys(st.seed, st.step)
    )
    np.testing.assert_array_equal(np.asarray(ne), 1)
    np.testing.assert_array_equal(np.asarray(got)[:, 0], np.asarray(want))


def test_outputs_layout_and_padding():
    p, q, x, nd = _toy_batch(b=64, k=4, seed=2)
    tok, ne = (np.asarray(a) for a in rejection_sample(p, q, x, nd, jax.random.key(1)))
    assert tok.shape == (64, 5) and tok.dtype == np.int32 and ne.dtype == np.int32
    assert np.all((ne >= 1) & (ne <= nd + 1))
    for b in range(64):
        n = ne[b]
        np.testing.assert_array_equal(tok[b, : n - 1], x[b, : n - 1])  # accepted drafts first
        assert 0 <= tok[b, n - 1] < V
        assert np.all(tok[b, n:] == -1)


def test_zero_q_and_zero_residual_give_no_nan():
    """q(x) = 0 for the proposed token (accept iff p(x) > 0) and p == q (zero residual) stay finite and valid."""
    v = 5
    p = np.array([[0.5, 0.5, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2]], np.float32)
    q = np.array([[0.0, 0.0, 1.0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2]], np.float32)
    tp = np.repeat(p[:, None], 2, 1)
    for tok_x, accepted in ((0, True), (3, False)):  # q(x) = 0: accepted iff p(x) > 0 (row 0)
        x = np.array([[tok_x], [1]], np.int32)
        keys = jax.random.split(jax.random.key(0), 2)
        tok, ne = rejection_sample(tp, q[:, None], x, np.ones(2, np.int32), keys)
        tok, ne = np.asarray(tok), np.asarray(ne)
        assert (ne[0] == 2) == accepted and tok[0, 0] in (0, 1) and tok[0, ne[0] - 1] in (0, 1)
        assert ne[1] == 2  # p == q: always accepted
    # Forced rejection with zero residual (float error): falls back to p instead of producing NaN / token 0.
    p1 = np.full((1, 2, v), 0.2, np.float32)
    q1 = np.full((1, 1, v), 0.2, np.float32)
    for s in range(20):
        tok, ne = rejection_sample(p1 * np.array([1, 1, 1, 1, 0.999999], np.float32), q1, np.array([[4]], np.int32),
                                   np.ones(1, np.int32), jax.random.key(s))  # fmt: skip
        assert 0 <= int(np.asarray(tok)[0, int(ne[0]) - 1]) < v


def test_processed_target_probs():
    logits = np.random.default_rng(0).standard_normal((3, 2, 10)).astype(np.float32)
    st = SamplingTensors.from_rows([dict(temperature=0.0), dict(temperature=1.0, top_k=3), dict(temperature=0.5)])
    pr = np.asarray(processed_target_probs(jnp.asarray(logits), st))
    np.testing.assert_allclose(pr.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(pr[0], np.eye(10)[logits[0].argmax(-1)])  # greedy: one-hot
    assert np.all((pr[1] > 0).sum(-1) == 3)  # top-k 3 at both positions
    z = logits[2] / 0.5
    np.testing.assert_allclose(pr[2], np.exp(z) / np.exp(z).sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(processed_target_probs(jnp.asarray(logits[:, 0]), st)), pr[:, 0])
    with pytest.raises(ValueError, match="logits"):
        processed_target_probs(jnp.zeros((2, 3, 4, 5)), st)


def test_bad_shapes_raise():
    p, q, x, nd = _toy_batch(b=3, k=2)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(p, q, x[:, :1], nd, key)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, q[:, :, :3], x, nd, key)
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(p, q, x, nd[:2], key)
    with pytest.raises(ValueError, match="key"):
        rejection_sample(p, q, x, nd, jax.random.split(key, 2))


# SmolLM2's real distribution ---------------------------------------------------------------------------------------


def _smollm2_last_logits(prompt: str) -> np.ndarray:
    from checkpoints.loader import default_model_path, load_checkpoint
    from model.kv import NoCache
    from model.transformer import build_model

    try:
        default_model_path(download=False)
    except FileNotFoundError:
        pytest.skip("the default SmolLM2 checkpoint is not cached")
    ckpt = load_checkpoint(None)
    model = build_model(ckpt.config, ckpt.params)
    ids = ckpt.tokenizer.encode(prompt)
    t = len(ids)
    logits, _ = model(jnp.asarray([ids]), jnp.arange(t)[None], None, NoCache(jnp.array([t])), jnp.array([[t - 1]]))
    return np.asarray(logits[0, 0], np.float32)  # [V]


def test_first_token_on_smollm2():
    """One forward of SmolLM2-135M; target = its next-token distribution after temperature 0.8, top-k 64, top-p
    0.95; draft = a perturbed, hotter, top-40 copy of it. The first emitted token's histogram over 1e5 draws matches
    the target on its top tokens. The statistical part runs on the union of the two supports (every other token has
    p = q = 0, so it can be neither proposed nor emitted: the rule on the full vocabulary is the rule on these
    columns); the full vocabulary is checked on a small batch."""
    logits = _smollm2_last_logits("The capital of France is Paris. The capital of Italy is")
    v = logits.shape[0]
    rng = np.random.default_rng(11)
    st_p = SamplingTensors.from_rows([dict(temperature=0.8, top_k=64, top_p=0.95)])
    st_q = SamplingTensors.from_rows([dict(temperature=1.2, top_k=40)])
    p = np.asarray(processed_target_probs(jnp.asarray(logits[None]), st_p))[0]
    noisy = logits + rng.standard_normal(v).astype(np.float32) * 1.5
    q = np.asarray(processed_target_probs(jnp.asarray(noisy[None]), st_q))[0]
    overlap = np.minimum(p, q).sum()  # the acceptance rate
    assert 0.1 < overlap < 0.95, overlap  # a draft that is neither useless nor the target itself

    # Full vocabulary, small batch: finite, in the target's support, accepted drafts first.
    b = 16
    x = rng.choice(v, size=(b, 1), p=q / q.sum()).astype(np.int32)
    tok, ne = rejection_sample(
        jnp.broadcast_to(jnp.asarray(p), (b, 2, v)), jnp.broadcast_to(jnp.asarray(q), (b, 1, v)),
        jnp.asarray(x), jnp.ones(b, jnp.int32), jax.random.key(0),
    )  # fmt: skip
    tok, ne = np.asarray(tok), np.asarray(ne)
    assert np.all(p[tok[np.arange(b), ne - 1]] > 0)

    cols = np.flatnonzero((p > 0) | (q > 0))
    pc, qc = p[cols], q[cols]
    np.testing.assert_allclose([pc.sum(), qc.sum()], 1.0, atol=1e-5)
    x = jax.random.categorical(jax.random.key(1), jnp.log(jnp.asarray(qc)), shape=(N, 1)).astype(jnp.int32)
    tok, _ = rejection_sample(
        jnp.broadcast_to(jnp.asarray(pc), (N, 2, cols.size)), jnp.broadcast_to(jnp.asarray(qc), (N, 1, cols.size)),
        x, jnp.ones(N, jnp.int32), jax.random.key(2),
    )  # fmt: skip
    hist = np.bincount(np.asarray(tok)[:, 0], minlength=cols.size) / N
    top = np.argsort(-pc)[:10]
    rest = np.setdiff1d(np.arange(cols.size), top)
    counts = np.append(hist[top], hist[rest].sum()) * N
    assert _chi2_pvalue(counts, np.append(pc[top], pc[rest].sum())) > P_MIN
    np.testing.assert_allclose(hist[top], pc[top], atol=0.01)
    assert np.argmax(hist) == np.argmax(pc)


# N-gram proposer ---------------------------------------------------------------------------------------------------


def _ngram(**kw):
    from serving.spec.proposers import NgramProposer

    return NgramProposer(**kw)


def test_ngram_proposes_the_continuation_of_the_longest_recent_match():
    ng = _ngram(max_n=4, min_n=1)
    assert ng.propose_one([1, 2, 3, 4, 1, 2, 3], 3).tolist() == [4, 1, 2]  # n=3 match at the start
    assert ng.propose_one([5, 6, 7, 5, 6, 8, 5, 6], 2).tolist() == [8, 5]  # most recent of two n=2 matches
    # n=2 ([9, 1]) beats the more recent n=1 match of [1]: longer suffixes first.
    assert ng.propose_one([9, 1, 4, 1, 7, 9, 1], 1).tolist() == [4]
    assert ng.propose_one([1, 2, 1], 5).tolist() == [2, 1, 2, 1, 2]  # past the end: copies its own drafts
    assert ng.propose_one([3, 4, 0, 3, 4, 3, 4], 3).tolist() == [3, 4, 3]  # n=2, latest of two: then periodic
    assert ng.propose_one([5, 3, 4, 0, 3, 4, 5, 3, 4], 2).tolist() == [0, 3]  # n=3 [5, 3, 4] beats n=2's latest
    assert ng.propose_one([1, 2, 3], 4).tolist() == []  # no earlier occurrence
    assert ng.propose_one([7], 4).tolist() == []
    assert ng.propose_one([1, 2, 1], 0).tolist() == []
    assert _ngram(max_n=3, min_n=2).propose_one([1, 2, 1], 3).tolist() == []  # n=1 not allowed
    assert _ngram(max_n=2, max_history=3).propose_one([1, 2, 9, 9, 1], 2).tolist() == []  # [1, 2] is out of the window


def test_ngram_batch_proposal_layout():
    from serving.spec.proposers import ProposalRow

    rows = [ProposalRow("a", [1, 2, 3, 1, 2], 3), ProposalRow("b", [4, 5], 5), ProposalRow("c", [1, 1, 1, 1], 2)]
    prop = _ngram().propose(rows)
    assert prop.draft_probs is None and prop.k_max == 5
    np.testing.assert_array_equal(prop.num_draft, [3, 0, 2])  # k drafts whenever an n-gram matches
    np.testing.assert_array_equal(prop.draft_tokens, [[3, 1, 2, -1, -1], [-1] * 5, [1, 1, -1, -1, -1]])
    assert prop.draft_tokens.dtype == np.int32 and prop.num_draft.dtype == np.int32


def test_ngram_bad_options_raise():
    from serving.spec.proposers import ProposalRow

    for kw, match in (
        (dict(min_n=0), "min_n"),
        (dict(max_n=1, min_n=2), "max_n"),
        (dict(max_history=2), "max_history"),
    ):
        with pytest.raises(ValueError, match=match):
            _ngram(**kw)
    with pytest.raises(ValueError, match="k must be"):
        _ngram().propose([ProposalRow(0, [1, 2], -1)])
    with pytest.raises(ValueError, match="empty"):
        _ngram().propose([ProposalRow(0, [], 2)])


def test_replay_greedy_counts_passes_and_acceptance():
    from serving.spec.proposers import replay_greedy

    # pass 1: no match, emits 1; pass 2: [1] matches, drafts [2, 3, 4], all right, emits them + 5.
    r = replay_greedy(_ngram(), [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], k=3)
    assert (r["passes"], r["drafted"], r["accepted"], r["trials"], r["acceptance"]) == (2, 3, 3, 3, 1.0)
    # A rejection: pass 2 drafts [2, 3] (2 tokens left to verify) against [2, 7]: 1 accepted of 2 trials; pass 3
    # has only the last token left (no drafts).
    r = replay_greedy(_ngram(), [1, 2, 3, 4, 5], [1, 2, 7, 7], k=3)
    assert (r["passes"], r["drafted"], r["accepted"], r["trials"]) == (3, 2, 1, 2)
    assert r["tokens"] == 4 and r["proposed_passes"] == 1


def test_ngram_drafts_through_the_sampler_keep_the_greedy_chain():
    """The n-gram proposer's one-hot drafts verified by rejection_sample against a greedy (one-hot) target emit
    exactly the target's tokens, and as many per pass as replay_greedy predicts."""
    from serving.spec.proposers import ProposalRow, replay_greedy

    v, k = 8, 4
    nxt = np.array([1, 2, 3, 0, 5, 6, 4, 7])  # a greedy target that cycles: copy-friendly
    seq, passes = [0, 1, 2, 4], 0
    ng = _ngram()
    while len(seq) < 40:
        prop = ng.propose([ProposalRow(0, seq, k)])
        d = int(prop.num_draft[0])
        drafts = np.zeros((1, k), np.int32)
        drafts[0, :d] = prop.draft_tokens[0, :d]
        ctx = np.array([seq[-1]] + drafts[0].tolist())
        target = np.eye(v, dtype=np.float32)[nxt[ctx]][None]  # [1, k+1, V]
        tok, ne = rejection_sample(target, None, drafts, np.array([d], np.int32), jax.random.key(passes))
        seq += np.asarray(tok)[0, : int(ne[0])].tolist()
        passes += 1
    want = [0, 1, 2, 4]
    while len(want) < len(seq):
        want.append(int(nxt[want[-1]]))
    assert seq == want
    assert passes == replay_greedy(ng, [0, 1, 2, 4], seq[4:], k)["passes"]
