"""Speculative decoding inside the on-device decode loop (serving/spec/device_loop.py), on CPU.

The device drafts are NgramProposer's on random histories; greedy output through the engine is token-identical with
the device loop, the host verify path and speculation off (tiny random model: max_tokens mid-iteration, a stop id,
shared prefixes; SmolLM2 on text that repeats, so drafts are accepted, and on text that does not); sampled rows are
reproducible per seed, and the first emitted token's empirical distribution through the loop is the target's
processed one (chi-square; a wrong acceptance rule fails it); the counters agree with the tokens; warm-up compiles
the loop for every decode bucket.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.kv import NoCache
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.engine.engine import LLMEngine
from serving.engine.runner import RowInput
from serving.spec import device_loop
from serving.spec.draft_model import ModelDraftProposer, make_model_proposer, runner_like
from serving.spec.policy import SpecPolicy
from serving.spec.proposers import NgramProposer
from serving.spec.rule import processed_target_probs
from serving.spec.verify import policy_config

TINY = ModelConfig.tiny()
OPTIONS = dict(
    attention_backend="xla",
    max_num_seqs=2,  # decode buckets 1 and 2: few compilations; a third request waits for a full batch
    max_num_batched_tokens=64,
    block_size=8,
    num_kv_blocks=96,
    max_model_len=128,
    decode_steps=4,
    speculative_method="ngram",
    num_speculative_tokens=3,
    warmup=False,
)


# On-device drafting ---------------------------------------------------------------------------------------------


def _histories(rng, n_rows: int, h: int):
    """Random histories over small alphabets (frequent matches), plus the edge cases: one token, no repeat at all, a
    repeat ending right before the last token, a period-1 run."""
    rows = [rng.integers(0, rng.choice([2, 3, 5, 40]), rng.integers(1, h - 8)).tolist() for _ in range(n_rows)]
    return rows + [[7], list(range(10, 30)), [5, 6, 9, 1, 2, 3, 1, 2, 3], [4] * 6, [1, 2, 1]]


@pytest.mark.parametrize("max_n, min_n, max_history", [(4, 1, 4096), (3, 2, 12), (1, 1, 9)])
def test_device_drafts_match_ngram_proposer(max_n, min_n, max_history):
    rng = np.random.default_rng(max_n * 10 + min_n)
    h, k = 48, 5
    rows = _histories(rng, 120, h)
    hist = np.zeros((len(rows), h), np.int32)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)
    fn = jax.jit(device_loop.ngram_drafts, static_argnums=(2, 3, 4, 5))
    drafts, found = (np.asarray(a) for a in fn(hist, lengths, k, max_n, min_n, max_history))
    proposer = NgramProposer(max_n=max_n, min_n=min_n, max_history=max_history)
    hits = 0
    for i, r in enumerate(rows):
        want = proposer.propose_one(r, k)
        assert bool(found[i]) == (want.size > 0), (i, r)
        if want.size:
            hits += 1
            np.testing.assert_array_equal(drafts[i], want, err_msg=str((i, r)))
    assert 20 < hits < len(rows)  # both outcomes are exercised


# The engine ---------------------------------------------------------------------------------------------------


def _always_drafting(engine):
    """The policy without its probing rest, so every row drafts (a rested row would make these tests vacuous)."""
    engine.spec.policy = SpecPolicy(policy_config(3, 0, probe_every=0))
    return engine


@pytest.fixture(scope="module")
def tiny():
    config = EngineConfig.from_kwargs(**OPTIONS)
    return _always_drafting(LLMEngine(random_model(TINY, jnp.float32, seed=7), NullTokenizer(), config))


@contextlib.contextmanager
def _mode(engine, mode: str):
    """'device': the on-device loop; 'host': one verify pass per host round trip; 'off': no speculation."""
    spec, enabled = engine.spec, engine.spec_loops.enabled
    engine.spec_loops.enabled = mode == "device"
    engine.spec = None if mode == "off" else spec
    try:
        yield
    finally:
        engine.spec, engine.spec_loops.enabled = spec, enabled


def _run(engine, requests, mode: str):
    """Output token ids per request; every KV block is back (only the prefix cache holds some) afterwards."""
    loops = engine.spec_loops.num_loops
    with _mode(engine, mode):
        rids = [engine.add_request(ids, params) for ids, params in requests]
        while engine.has_unfinished():
            engine.step()
            engine.scheduler.check_invariants()
    sched = engine.scheduler
    assert sched.block_manager.num_used == (sched.cache.num_cached_blocks if sched.cache is not None else 0)
    assert (engine.spec_loops.num_loops > loops) == (mode == "device")
    return [list(engine.pop_finished(r).request.output_token_ids) for r in rids]


def _tiny_requests():
    rng = np.random.default_rng(3)
    motif = rng.integers(3, 500, 5).tolist()
    shared = rng.integers(3, 500, 19).tolist()
    prompts = [motif * 6, shared + [11, 12], shared + [13], rng.integers(3, 500, 9).tolist()]
    # max_tokens land inside a loop's iterations (a loop emits up to 4 * (3 + 1) tokens per row)
    return [
        (p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)) for p, m in zip(prompts, [37, 9, 22, 5])
    ]


def test_warmup_compiles_every_decode_bucket(tiny):
    runner = tiny.runner
    widths = runner.width_buckets[:1]
    for key in [k for k in runner._compiled if k[0] == "spec_loop"]:  # compiled by the tests before: forget them
        del runner._compiled[key]
    assert tiny.spec_loops.warmup(widths) == len(runner.decode_buckets)
    keys = {k for k in runner._compiled if k[0] == "spec_loop"}
    assert {(k[3], k[4]) for k in keys} >= {(s, widths[0]) for s in runner.decode_buckets}
    n = runner.num_compiles
    assert tiny.spec_loops.warmup(widths) == 0 and runner.num_compiles == n
    _run(tiny, _tiny_requests()[:3], "device")
    assert {k for k in runner._compiled if k[0] == "spec_loop"} == keys  # no spec loop compiled while serving


def _totals(c) -> np.ndarray:
    return np.array([c.passes, c.drafted, c.accepted, c.emitted])


def test_greedy_device_loop_matches_host_path_and_off(tiny, monkeypatch):
    reqs = _tiny_requests()
    off = _run(tiny, reqs, "off")
    c = tiny.spec.counters
    loops, host = np.zeros(4, int), np.zeros(4, int)  # (passes, drafted, accepted, emitted) of the loops / host steps
    dispatch, step = tiny.spec_loops.dispatch, tiny.spec.step

    def checked(rows, limits, draft_on):  # what each loop returns adds up, within the rows' limits
        res = dispatch(rows, limits, draft_on)
        assert np.all(res.counts <= limits) and np.array_equal(res.counts, res.emitted.sum(axis=0))
        d, e = res.drafted, res.emitted
        before = np.cumsum(np.vstack([np.zeros((1, e.shape[1]), int), e[:-1]]), axis=0)  # tokens before each pass
        room = np.clip(np.asarray(limits)[None, :] - before - 1, 0, 3)  # k = 3, fewer near the row's limit
        assert np.all((d == 0) | (d == room)), (d, room)
        loops[:] += [np.sum(d > 0), d.sum(), np.where(d > 0, e - 1, 0).sum(), np.where(d > 0, e, 0).sum()]
        return res

    def host_step(out):  # mixed steps (a prefill beside decode rows) verify on the host
        before = _totals(c)
        got = step(out)
        host[:] += _totals(c) - before
        return got

    monkeypatch.setattr(tiny.spec_loops, "dispatch", checked)
    monkeypatch.setattr(tiny.spec, "step", host_step)
    before = _totals(c)
    assert _run(tiny, reqs, "device") == off
    assert 0 < loops[1] <= 3 * loops[0] and loops[1] > 2 * loops[0]  # the loops drafted, k = 3 per pass mostly
    np.testing.assert_array_equal(_totals(c) - before, loops + host)  # the counters are fed from the loops
    assert _run(tiny, reqs, "host") == off
    assert [len(o) for o in off] == [37, 9, 22, 5]


def test_greedy_batch_of_one_stop_id_and_short_search_window(tiny, monkeypatch):
    prompt, params = _tiny_requests()[0]
    (off,) = _run(tiny, [(prompt, params)], "off")
    (dev,) = _run(tiny, [(prompt, params)], "device")
    assert dev == off
    # a search window shorter than the prompt: the loop holds only its tail (positions from an offset)
    monkeypatch.setattr(tiny.spec, "proposer", NgramProposer(max_n=4, min_n=1, max_history=12))
    drafted = tiny.spec.counters.drafted
    assert _run(tiny, [(prompt, params)], "device") == [off]
    assert tiny.spec.counters.drafted > drafted
    monkeypatch.undo()
    stop = off[12]  # a stop id emitted mid-run: the output ends at its first occurrence
    first = off.index(stop)
    stopped = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    (got,) = _run(tiny, [(prompt, stopped)], "device")
    assert got == off[: first + 1]


def test_seeded_sampling_is_reproducible(tiny):
    prompt = _tiny_requests()[0][0]
    reqs = [(prompt, SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=s, ignore_eos=True)) for s in (1, 2)]
    a = _run(tiny, reqs, "device")
    assert _run(tiny, reqs, "device") == a
    assert a[0] != a[1]
    assert all(len(o) == 30 for o in a)


# Model drafts on device (a draft model with its own paged KV, self-speculation) -----------------------------------


def _model_proposer(engine, kind: str):
    """'twin': the target itself as a draft model with its own KV pool (float32: every draft must be accepted, which
    holds only while the loop keeps the draft KV complete); 'self': the target's first layer on its own KV."""
    r = engine.runner
    if kind == "self":
        return make_model_proposer("self", r, nnx.merge(r.graphdef, r.params), engine.config.speculative, None)
    return ModelDraftProposer(runner_like(r, nnx.merge(r.graphdef, r.params)), "draft")


@pytest.mark.parametrize("kind", ["twin", "self"])
def test_model_drafts_in_the_device_loop_match_off(tiny, monkeypatch, kind):
    reqs = _tiny_requests()
    off = _run(tiny, reqs, "off")
    monkeypatch.setattr(tiny.spec, "proposer", _model_proposer(tiny, kind))
    c = tiny.spec.counters
    before = _totals(c)
    keys = {k for k in tiny.runner._compiled if k[0] == "draft_loop"}
    assert _run(tiny, reqs, "device") == off
    passes, drafted, accepted, _ = _totals(c) - before
    assert {k for k in tiny.runner._compiled if k[0] == "draft_loop"} > keys  # the draft loop ran
    assert passes > 0 and 2 * passes < drafted <= 3 * passes
    if kind == "twin":  # the host's verify passes (mixed steps) and the loops' alike
        assert accepted == drafted, (accepted, drafted)
    assert _run(tiny, reqs, "host") == off
    assert tiny.step() == [] and not tiny.spec.proposer.tracked  # an idle step releases the finished rows' state


@pytest.fixture
def no_persistent_cache():
    """JAX's persistent cache off for the test: on XLA:CPU an executable it loaded, serialized again into the
    runner's cache, does not read back (why the engine keeps no executable cache on a CPU host; an earlier test in
    the process may have turned JAX's cache on)."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether its cache is used: decide again
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


def test_draft_loop_from_the_executable_cache_and_no_pool_copies(tmp_path, no_persistent_cache):
    """A second engine on the same cache directory loads the twin draft's loops (their output tree holds the
    draft's KV beside the stats) and serves the same tokens; neither KV pool is copied inside the loop (both
    donated)."""
    from serving.engine.executable_cache import ExecutableCache

    engines = []
    for _ in range(2):
        config = EngineConfig.from_kwargs(**OPTIONS)
        engine = _always_drafting(LLMEngine(random_model(TINY, jnp.float32, seed=7), NullTokenizer(), config))
        engine.runner._cache = ExecutableCache(str(tmp_path))  # the engine keeps none on a CPU host: the runner's
        engine.spec.proposer = _model_proposer(engine, "twin")
        engines.append(engine)
    first, second = engines
    widths = first.runner.width_buckets[:1]
    assert first.spec_loops.warmup(widths) == len(first.runner.decode_buckets)
    hits = second.runner._cache.hits
    assert second.spec_loops.warmup(widths) == 0 and second.runner._cache.hits - hits == len(widths) * 2
    reqs = _tiny_requests()[:2]
    assert _run(second, reqs, "device") == _run(first, reqs, "device")
    loops = second.spec_loops
    exe = first.runner._compiled[loops._key(1, widths[0])]
    for pool in (first.runner.kv_cache[0][0], first.spec.proposer.runner.kv_cache[0][0]):
        shape = f"f32[{','.join(map(str, pool.shape))}]"
        copies = [line for line in exe.as_text().splitlines() if " copy(" in line and shape in line]
        assert not copies, copies[:2]


# The distribution of sampled rows -------------------------------------------------------------------------------


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of `counts` against `probs` (cells expecting < 5 merged)."""
    import scipy.stats

    probs = probs.astype(np.float64)
    expected = probs / probs.sum() * counts.sum()
    if np.any(counts[expected == 0] > 0):
        return 0.0  # a token outside the target's support
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    return float(scipy.stats.chi2.sf(stat, int(keep.sum()) - 1))


def _first_tokens(engine, hist: list[int], st_row: dict, n: int) -> np.ndarray:
    """The first token n rows with the same history (seeds 0..n-1) emit through one loop iteration; all rows share
    the history's KV blocks (their writes are identical: same tokens, same drafts)."""
    r, k = engine.runner, engine.spec.max_k
    bs = r.block_size
    table = list(range(1, 1 + -(-(len(hist) + k + 1) // bs)))
    r.forward([RowInput(hist[:-1], 0, table)])  # the history's KV but the last token's (the loop writes it)
    fn = device_loop.spec_loop_fn(r, 1, k, ("ngram", 4, 1, 4096))
    hw = 128
    tiled = np.zeros((n, hw), np.int32)
    tiled[:, : len(hist)] = hist
    st = SamplingTensors.from_rows([dict(st_row, seed=i) for i in range(n)])
    tables = np.tile(np.asarray(table, np.int32), (n, 1))
    lengths, offsets = np.full(n, len(hist), np.int32), np.zeros(n, np.int32)
    args = (tiled, lengths, offsets, tables, np.full(n, k + 1, np.int32), np.ones(n, np.int32))
    stops = np.full((n, device_loop.MAX_STOP_IDS), -1, np.int32)
    tok, stats, r.kv_cache, _ = fn(r.params, r.kv_cache, *args, stops, st)
    stats = np.asarray(stats)
    assert np.all(stats[1] == k)  # every row drafted
    return np.asarray(tok)[0], stats


def _target_probs(engine, hist: list[int], st_row: dict) -> np.ndarray:
    r = engine.runner  # its parameters merged back into a model, run under plain causal attention
    m = nnx.merge(r.graphdef, r.params)
    toks = jnp.asarray([hist], jnp.int32)
    logits = m(toks, jnp.arange(len(hist))[None], None, NoCache(jnp.asarray([len(hist)])))[0]
    return np.asarray(processed_target_probs(logits[:, -1], SamplingTensors.from_rows([st_row])))[0]


def _draft_history(engine, st_row: dict) -> tuple[list[int], int]:
    """A history whose first draft d (the token after an earlier occurrence of its last token) has target
    probability in [0.25, 0.75]: then both the acceptance and the residual draw matter."""
    rng = np.random.default_rng(0)
    base = rng.integers(3, 500, 9).tolist()
    for d in range(3, 500):
        hist = base[:5] + [base[8], d] + base[5:9]
        p = _target_probs(engine, hist, st_row)
        if 0.25 <= p[d] <= 0.75:
            return hist, d
    raise AssertionError("no history with a mid-probability draft")


N_DRAWS = 1024


def test_first_token_distribution_is_the_targets(tiny, monkeypatch):
    st_row = dict(temperature=1.0, top_k=4)
    hist, d = _draft_history(tiny, st_row)
    p = _target_probs(tiny, hist, st_row)
    first, stats = _first_tokens(tiny, hist, st_row, N_DRAWS)
    counts = np.bincount(first, minlength=p.size).astype(np.float64)
    assert _chi2_pvalue(counts, p) > 0.01
    accepted = stats[2] > 1
    assert 0.1 < accepted.mean() < 0.9 and np.all(first[accepted] == d)  # both branches of the rule ran

    def always_accept(target_probs, draft_probs, draft_tokens, num_draft, key):  # the wrong rule: no rejection
        b, k1 = target_probs.shape[:2]
        tokens = jnp.concatenate([draft_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
        return tokens, jnp.minimum(num_draft + 1, k1)

    monkeypatch.setattr(device_loop, "rejection_sample", always_accept)
    wrong, _ = _first_tokens(tiny, hist, st_row, N_DRAWS)
    assert _chi2_pvalue(np.bincount(wrong, minlength=p.size).astype(np.float64), p) < 1e-6


# SmolLM2: drafts that are accepted --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    from serving.engine.llm import LLM

    llm = LLM(**dict(OPTIONS, dtype="float32", block_size=16, max_model_len=160, num_kv_blocks=64))  # exact identity
    _always_drafting(llm.engine)
    return llm


def test_smollm2_greedy_identical_and_counters(smol, monkeypatch):
    """Copy-heavy, free and fully repetitive prompts in one batch: the device loop's tokens are plain decoding's,
    the counters add up, and on the repeating pattern nearly every draft is accepted."""
    engine = smol.engine
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [
        smol.encode_prompt(f"Repeat this code exactly:\n{code}", chat=True),
        smol.encode_prompt("Name three colours.", chat=True),
        smol.encode_prompt("1, 2, 3, 4, " * 5, chat=False),
    ]
    reqs = [(p, SamplingParams(max_tokens=32, temperature=0.0)) for p in prompts]
    off = _run(engine, reqs, "off")
    per_row: dict = {}
    dispatch = engine.spec_loops.dispatch

    def spy(rows, limits, draft_on):  # each loop's drafts and accepted drafts, by prompt
        res = dispatch(rows, limits, draft_on)
        for i, r in enumerate(rows):
            d, e = res.drafted[:, i], res.emitted[:, i]
            got = per_row.setdefault(prompts.index(list(r.prompt_token_ids)), [0, 0])
            got[0] += int(d.sum())
            got[1] += int(np.where(d > 0, np.maximum(e - 1, 0), 0).sum())
        return res

    monkeypatch.setattr(engine.spec_loops, "dispatch", spy)
    c = engine.spec.counters
    before = (c.passes, c.drafted, c.accepted, c.emitted)
    assert _run(engine, reqs, "device") == off
    passes, drafted, accepted, emitted = (a - b for a, b in zip((c.passes, c.drafted, c.accepted, c.emitted), before))
    assert 2 * passes < drafted <= 3 * passes and emitted == accepted + passes
    assert [drafted, accepted] == [sum(v[0] for v in per_row.values()), sum(v[1] for v in per_row.values())]
    assert per_row[0][1] > 0  # the code is copied: drafts accepted
    assert per_row[2][1] > 0.8 * per_row[2][0], per_row  # the repeating pattern


# The GPU kernels (the ragged Triton kernel verifies; plain decoding runs the decode kernel) --------------------------

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["ngram", "twin"])
def test_device_loop_on_gpu_kernels_matches_off(kind):
    """The tiny model on the default kernels (CPU tests run the XLA reference; the interpreter of the Pallas kernel
    agreed by hand): greedy tokens of the device loop equal plain decoding's, with drafts accepted (the twin draft
    model, whose draft steps run the paged decode kernel inside the loop: nearly all)."""
    options = dict(OPTIONS, attention_backend=None, max_num_seqs=4, block_size=16, num_kv_blocks=64)
    engine = _always_drafting(
        LLMEngine(random_model(TINY, jnp.float32, seed=7), NullTokenizer(), EngineConfig.from_kwargs(**options))
    )
    if kind == "twin":
        engine.spec.proposer = _model_proposer(engine, "twin")
    reqs = _tiny_requests()
    off = _run(engine, reqs, "off")
    c = engine.spec.counters
    assert _run(engine, reqs, "device") == off
    assert c.accepted > 0 and c.drafted > 0
    if kind == "twin":
        assert c.accepted > 0.9 * c.drafted
