"""LLMEngine exactness against the contiguous-cache reference path, on the default model (SmolLM2, float32, CPU).

One LLM (one ModelRunner, so one set of compiled executables) serves the whole module. Tests that need another
scheduler configuration (prefix caching off, a smaller token budget, a small KV pool that forces preemption) give
the engine a fresh `Scheduler` over the same runner: block ids of a smaller pool are valid pages of the runner's
cache, and the runner's compiled shapes do not depend on the scheduler, so nothing recompiles. The reference
outputs for every prompt of the module come from one batched `generate_reference` call.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.core.scheduler import Scheduler
from serving.engine.engine import LLMEngine
from serving.engine.reference import generate_reference
from serving.engine.sampler import sample_rows

MAX_MODEL_LEN = 128
DECODE_STEPS = 4
ENGINE_OPTIONS = dict(
    attention_backend="xla",
    max_num_seqs=16,
    max_num_batched_tokens=32,
    block_size=16,
    num_kv_blocks=128,
    decode_steps=DECODE_STEPS,
)
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50)


def _random_prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, n).tolist() for n in lengths]


# 18 requests (more than max_num_seqs) of mixed prompt lengths around block and budget boundaries; the first 16
# decode long enough to all run together, the last two barely decode.
MIXED_PROMPTS = _random_prompts(0, [1, 3, 7, 12, 16, 17, 23, 31, 32, 33, 40, 47, 50, 58, 63, 64, 9, 28])
MIXED_MAX_TOKENS = [32, 32, 32, 30, 30, 28, 32, 26, 31, 29, 24, 27, 32, 20, 30, 25, 1, 2]

# Three shared prefixes (2-3 full blocks each) with four distinct suffixes, plus four unrelated prompts.
_PREFIXES = _random_prompts(1, [40, 48, 33])
_SUFFIXES = _random_prompts(2, [2, 5, 9, 14])
PREFIX_PROMPTS = [p + s for p in _PREFIXES for s in _SUFFIXES] + _random_prompts(3, [20, 35, 6, 50])
PREFIX_MAX_TOKENS = [(3 * i) % 17 + 4 for i in range(len(PREFIX_PROMPTS))]

# Seeded sampling: one target request and the prompts it shares a batch with.
SAMPLED_PROMPTS = _random_prompts(4, [21, 44])
SAMPLED_SEEDS = [1234, 99]
SAMPLED_MAX_TOKENS = [20, 16]

CHAT_QUESTION = "What is 2+2? Reply with just the number."  # SmolLM2 answers in a few tokens, then EOS


@pytest.fixture(scope="module")
def llm():
    from serving.engine.llm import LLM

    return LLM(max_model_len=MAX_MODEL_LEN, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def engine(llm) -> LLMEngine:
    return llm.engine


@pytest.fixture(scope="module")
def chat_prompt(llm) -> list[int]:
    return llm.encode_prompt(CHAT_QUESTION, chat=True)


@pytest.fixture(scope="module")
def reference(llm, chat_prompt):
    """(prompt tuple, seed or None) -> reference token ids, for every prompt of the module in one batch."""
    keys, rows, limits = [], [], []
    for prompts, max_tokens in (
        (MIXED_PROMPTS, MIXED_MAX_TOKENS),
        (PREFIX_PROMPTS, PREFIX_MAX_TOKENS),
        ([chat_prompt], [24]),
    ):
        for p, m in zip(prompts, max_tokens):
            keys.append((tuple(p), None))
            rows.append(dict(temperature=0.0))
            limits.append(m)
    for p, seed, m in zip(SAMPLED_PROMPTS, SAMPLED_SEEDS, SAMPLED_MAX_TOKENS):
        keys.append((tuple(p), seed))
        rows.append(dict(SAMPLED, seed=seed))
        limits.append(m)
    out = generate_reference(
        llm.model, [list(k[0]) for k in keys], rows, limits, llm.config.eos_token_ids, MAX_MODEL_LEN
    )
    return dict(zip(keys, out.token_ids))


def use_scheduler(engine: LLMEngine, **overrides) -> Scheduler:
    """Gives the engine a fresh scheduler (empty prefix cache, zeroed counters) over the same runner."""
    assert not engine.has_unfinished()
    c = engine.config
    args = dict(
        num_blocks=engine.runner.num_blocks,
        block_size=c.block_size,
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        enable_prefix_caching=c.enable_prefix_caching,
    )
    args.update(overrides)
    engine.scheduler = Scheduler(**args)
    return engine.scheduler


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], schedules: list | None = None):
    """Adds every request, steps until all finish (checking scheduler invariants each step), returns the tracks.

    `schedules`, when given, collects every SchedulerOutput.
    """
    sched = engine.scheduler
    if schedules is not None:
        original = sched.schedule

        def spy():
            out = original()
            schedules.append(out)
            return out

        sched.schedule = spy
    rids = [engine.add_request(ids, params) for ids, params in requests]
    while engine.has_unfinished():
        engine.step()
        sched.check_invariants()
    assert_only_cache_holds_blocks(sched)
    return [engine.pop_finished(rid) for rid in rids]


def assert_only_cache_holds_blocks(sched: Scheduler) -> None:
    sched.check_invariants()
    cached = sched.cache.num_cached_blocks if sched.cache is not None else 0
    assert sched.block_manager.num_used == cached


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_matches_reference(tracks, prompts, max_tokens, reference):
    for i, (track, p, m) in enumerate(zip(tracks, prompts, max_tokens)):
        ref = reference[(tuple(p), None)]
        assert track.request.output_token_ids == ref, f"request {i} (prompt {len(p)} tokens, max_tokens {m})"
        ended_by_eos = ref[-1] in track.request.eos_token_ids
        assert track.request.finish_reason == ("stop" if ended_by_eos else "length")
        assert len(ref) == m or ended_by_eos


# Greedy exactness ------------------------------------------------------------------------------------------------


def test_greedy_mixed_batch_matches_reference(engine, reference):
    use_scheduler(engine, enable_prefix_caching=False)
    loops_before = engine.num_decode_loops
    schedules = []
    tracks = run(engine, [(p, greedy(m)) for p, m in zip(MIXED_PROMPTS, MIXED_MAX_TOKENS)], schedules)
    assert_matches_reference(tracks, MIXED_PROMPTS, MIXED_MAX_TOKENS, reference)
    assert max(len(s.scheduled) for s in schedules) == engine.config.max_num_seqs  # 16 rows in one step
    assert engine.num_decode_loops > loops_before  # the multi-step decode loop ran, and stayed exact


def test_decode_loop_runs_while_requests_wait_for_a_slot(engine, reference):
    """With every slot taken, waiting requests cannot be admitted anyway: decoding stays on device and exact."""
    sched = use_scheduler(engine, enable_prefix_caching=False, max_num_seqs=4)
    saved = engine.config
    engine.config = saved.replace(max_num_seqs=4)
    try:
        loops_while_waiting = []
        original = engine.loops.launch

        def spy(out, limits):
            loops_while_waiting.append(sched.num_waiting)
            return original(out, limits)

        engine.loops.launch = spy
        prompts, max_tokens = MIXED_PROMPTS[:6], MIXED_MAX_TOKENS[:6]
        tracks = run(engine, [(p, greedy(m)) for p, m in zip(prompts, max_tokens)])
    finally:
        engine.config = saved
        del engine.loops.launch
    assert_matches_reference(tracks, prompts, max_tokens, reference)
    assert any(n > 0 for n in loops_while_waiting), loops_while_waiting


def test_decode_loop_runs_while_requests_wait_for_blocks(engine, reference):
    """With free slots but too few free KV blocks (a long queue's KV-bound regime), waiting requests cannot start
    until a running one ends either: decoding stays on device there too, and exact."""
    sched = use_scheduler(engine, enable_prefix_caching=False, num_blocks=9)  # 8 usable: about two requests at once
    launches = []
    original = engine.loops.launch

    def spy(out, limits):
        launches.append((sched.num_waiting, sched.num_running))
        return original(out, limits)

    engine.loops.launch = spy
    try:
        prompts, max_tokens = MIXED_PROMPTS[6:11], MIXED_MAX_TOKENS[6:11]
        tracks = run(engine, [(p, greedy(m)) for p, m in zip(prompts, max_tokens)])
    finally:
        del engine.loops.launch
    assert_matches_reference(tracks, prompts, max_tokens, reference)
    assert any(w > 0 and r < engine.config.max_num_seqs for w, r in launches), launches


def test_async_scheduling_is_exact(engine, reference):
    """Loops launched before the host applied the previous one (overlap) give the tokens of overlap off."""
    outputs = {}
    for overlap in (True, False):
        use_scheduler(engine, enable_prefix_caching=False)
        engine.overlap = overlap
        chained = engine.loops.num_chained
        try:
            tracks = run(engine, [(p, greedy(m)) for p, m in zip(MIXED_PROMPTS, MIXED_MAX_TOKENS)])
        finally:
            engine.overlap = True
        assert (engine.loops.num_chained > chained) == overlap  # overlap on: loops were chained
        outputs[overlap] = [t.request.output_token_ids for t in tracks]
        assert_matches_reference(tracks, MIXED_PROMPTS, MIXED_MAX_TOKENS, reference)
    assert outputs[True] == outputs[False]


def test_warm_chain_covers_every_chained_gather(engine):
    """After warm_chain, chained loops whose rows shrink (requests finishing at different lengths) compile no token
    gather while serving (the engine's warm-up used to leave them to first use)."""
    from serving.engine.runner import chain_tokens

    use_scheduler(engine, enable_prefix_caching=False)
    engine.loops.warm_chain()
    warmed, chained = chain_tokens._cache_size(), engine.loops.num_chained
    run(engine, [(p, greedy(m)) for p, m in zip(MIXED_PROMPTS, MIXED_MAX_TOKENS)])
    assert engine.loops.num_chained > chained
    assert chain_tokens._cache_size() == warmed, "a chained loop's gather compiled while serving"


def test_greedy_with_prefix_caching_matches_reference(engine, reference):
    sched = use_scheduler(engine, enable_prefix_caching=True)
    requests = [(p, greedy(m)) for p, m in zip(PREFIX_PROMPTS, PREFIX_MAX_TOKENS)]
    tracks = run(engine, requests)
    assert_matches_reference(tracks, PREFIX_PROMPTS, PREFIX_MAX_TOKENS, reference)
    hits_first = sched.prefix_hit_tokens
    assert hits_first > 0  # later suffixes of a prefix reuse the blocks of the first
    assert sched.cache.num_cached_blocks > 0
    # Second round: every prompt's full blocks are cached now.
    tracks = run(engine, requests)
    assert_matches_reference(tracks, PREFIX_PROMPTS, PREFIX_MAX_TOKENS, reference)
    second = sched.prefix_hit_tokens - hits_first
    expected = sum((len(p) - 1) // 16 * 16 for p in PREFIX_PROMPTS)
    assert second == expected, (second, expected)
    assert all(t.request.num_cached_tokens == (len(p) - 1) // 16 * 16 for t, p in zip(tracks, PREFIX_PROMPTS))


def test_greedy_with_chunked_prefill_matches_reference(engine, reference):
    use_scheduler(engine, max_num_batched_tokens=16)
    schedules = []
    tracks = run(engine, [(p, greedy(m)) for p, m in zip(MIXED_PROMPTS, MIXED_MAX_TOKENS)], schedules)
    assert_matches_reference(tracks, MIXED_PROMPTS, MIXED_MAX_TOKENS, reference)
    chunks = [sr for s in schedules for sr in s.scheduled if not sr.sample]
    assert chunks, "no prompt was split into chunks"
    assert all(s.num_batched_tokens <= 16 for s in schedules)
    # Decode rows and prefill chunks shared steps.
    assert any(
        any(len(sr.token_ids) == 1 for sr in s.scheduled) and any(len(sr.token_ids) > 1 for sr in s.scheduled)
        for s in schedules
    )


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_with_preemption_matches_reference(engine, reference, prefix_caching):
    sched = use_scheduler(engine, num_blocks=20, enable_prefix_caching=prefix_caching)  # 19 blocks, 304 tokens
    tracks = run(engine, [(p, greedy(m)) for p, m in zip(MIXED_PROMPTS, MIXED_MAX_TOKENS)])
    assert sched.num_preemptions > 0
    assert_matches_reference(tracks, MIXED_PROMPTS, MIXED_MAX_TOKENS, reference)


# Sampling --------------------------------------------------------------------------------------------------------


def _sampled_params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=SAMPLED_MAX_TOKENS[i], seed=SAMPLED_SEEDS[i], **SAMPLED)


def test_seeded_sampling_alone_equals_in_batch_and_reference(engine, reference):
    use_scheduler(engine)
    target = (SAMPLED_PROMPTS[0], _sampled_params(0))
    (alone,) = run(engine, [target])
    others = [(p, greedy(m)) for p, m in zip(MIXED_PROMPTS[:9], MIXED_MAX_TOKENS[:9])]
    others.insert(3, (SAMPLED_PROMPTS[1], _sampled_params(1)))
    others += [
        (p, SamplingParams(max_tokens=12, seed=7 + i, temperature=1.0)) for i, p in enumerate(PREFIX_PROMPTS[:4])
    ]
    tracks = run(engine, others[:5] + [target] + others[5:])
    in_batch = tracks[5]
    assert alone.request.output_token_ids == in_batch.request.output_token_ids
    assert alone.request.output_token_ids == reference[(tuple(SAMPLED_PROMPTS[0]), SAMPLED_SEEDS[0])]
    assert tracks[3].request.output_token_ids == reference[(tuple(SAMPLED_PROMPTS[1]), SAMPLED_SEEDS[1])]


# Abort -----------------------------------------------------------------------------------------------------------


def _assert_released(sched: Scheduler, blocks: list[int]) -> None:
    """Blocks an aborted request held are free or held only by the cache and live requests."""
    sched.check_invariants()
    live = {b for r in sched.running for b in r.block_ids}
    cached = set(sched.cache.cached_block_ids()) if sched.cache is not None else set()
    for b in blocks:
        if b not in live:
            assert sched.block_manager.refcount(b) == (1 if b in cached else 0), b


def test_abort_frees_blocks(engine):
    sched = use_scheduler(engine)
    long_rid = engine.add_request(MIXED_PROMPTS[15], greedy(20))  # 64 tokens: two prefill chunks of 32
    rids = [engine.add_request(p, greedy(20)) for p in MIXED_PROMPTS[1:4]]
    waiting_rid = engine.add_request(MIXED_PROMPTS[5], greedy(20))
    engine.step()
    long_req = sched.requests[long_rid]
    assert 0 < long_req.num_computed_tokens < long_req.num_prompt_tokens  # mid-prefill
    blocks = list(long_req.block_ids)
    engine.abort(long_rid)
    _assert_released(sched, blocks)
    assert long_rid not in sched.requests
    engine.abort(waiting_rid)  # never scheduled: nothing to free, just gone
    sched.check_invariants()
    while min(sched.requests[r].num_output_tokens for r in rids) < 3:
        engine.step()
    victim = sched.requests[rids[1]]
    assert victim.num_output_tokens < 20  # mid-generation
    blocks = list(victim.block_ids)
    engine.abort(rids[1])
    _assert_released(sched, blocks)
    while engine.has_unfinished():
        engine.step()
    assert_only_cache_holds_blocks(sched)
    assert engine.pop_finished(rids[0]).request.num_output_tokens == 20
    assert engine.pop_finished(rids[1]) is None


# Stop conditions -------------------------------------------------------------------------------------------------


def test_stop_token_ids_and_max_tokens(engine, reference):
    use_scheduler(engine)
    prompt = MIXED_PROMPTS[10]
    ref = reference[(tuple(prompt), None)]
    j = next(j for j in range(6, len(ref)) if ref[j] not in ref[:j])
    stop_tok, budget = run(engine, [(prompt, greedy(24, stop_token_ids=(ref[j],))), (prompt, greedy(5))])
    assert stop_tok.request.output_token_ids == ref[: j + 1]  # the stop token is in the ids
    assert stop_tok.request.finish_reason == "stop"
    assert budget.request.output_token_ids == ref[:5] and budget.request.finish_reason == "length"


def test_stop_strings(engine, llm, reference):
    use_scheduler(engine)
    prompt = MIXED_PROMPTS[6]
    (full,) = run(engine, [(prompt, greedy(32))])
    assert full.request.output_token_ids == reference[(tuple(prompt), None)]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    assert cut > 0, text
    stopped, never = run(engine, [(prompt, greedy(32, stop=(stop,))), (prompt, greedy(32, stop=("\x00zz",)))])
    assert stopped.request.finish_reason == "stop"
    assert stopped.text == text[:cut]
    ids = stopped.request.output_token_ids
    assert ids == full.request.output_token_ids[: len(ids)] and len(ids) < len(full.request.output_token_ids)
    assert stop in llm.tokenizer.decode(ids) and stop not in llm.tokenizer.decode(ids[:-1])
    assert never.text == text and never.request.finish_reason == full.request.finish_reason


def test_min_tokens_and_ignore_eos(engine, reference, chat_prompt):
    use_scheduler(engine)
    ref = reference[(tuple(chat_prompt), None)]
    eos = engine.eos_token_ids[0]
    j = len(ref) - 1
    assert ref[j] == eos and eos not in ref[:j], ref  # the model answers, then ends
    plain, min_tok, ignore = run(
        engine,
        [
            (chat_prompt, greedy(24)),
            (chat_prompt, greedy(24, min_tokens=j + 4)),
            (chat_prompt, greedy(j + 6, ignore_eos=True)),
        ],
    )
    assert plain.request.output_token_ids == ref and plain.request.finish_reason == "stop"
    out = min_tok.request.output_token_ids
    assert out[:j] == ref[:j] and eos not in out[: j + 3] and len(out) >= j + 4
    out = ignore.request.output_token_ids
    assert out[: j + 1] == ref and len(out) == j + 6 and ignore.request.finish_reason == "length"


def test_logprobs_match_score(engine, llm):
    use_scheduler(engine)
    prompt = MIXED_PROMPTS[9]
    params = [greedy(6, logprobs=5), SamplingParams(max_tokens=6, seed=3, logprobs=5, ignore_eos=True, **SAMPLED)]
    rids = [engine.add_request(prompt, p) for p in params]
    entries = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.new_logprobs is not None and len(o.new_logprobs) == len(o.new_token_ids)
            entries[o.request_id] += o.new_logprobs
    for rid in rids:
        out = engine.pop_finished(rid).request.output_token_ids
        assert len(entries[rid]) == len(out) == 6
        logits = llm.score(prompt + out[:-1])[len(prompt) - 1 :]  # [6, V]: the distributions each token came from
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        for i, (tok, (lp, top)) in enumerate(zip(out, entries[rid])):
            assert len(top) == 5
            np.testing.assert_allclose(lp, logp[i, tok], atol=1e-4)
            top_ids = [t for t, _ in top]
            np.testing.assert_array_equal(top_ids, np.argsort(-logp[i])[:5])
            np.testing.assert_allclose([v for _, v in top], logp[i][top_ids], atol=1e-4)
        if rid == rids[0]:
            assert all(top[0][0] == tok for tok, (_, top) in zip(out, entries[rid]))


# Compilation -----------------------------------------------------------------------------------------------------


def _mixed_workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 64, 20)
    prompts = _random_prompts(seed, lengths)
    out = []
    for i, p in enumerate(prompts):
        m = int(rng.integers(1, 30))
        kind = i % 4
        if kind == 0:
            params = greedy(m)
        elif kind == 1:
            params = SamplingParams(max_tokens=m, seed=i, **SAMPLED)
        elif kind == 2:
            params = greedy(m, stop=("the",), min_tokens=min(m, 2))
        else:
            params = SamplingParams(max_tokens=m, seed=i, temperature=0.7, logprobs=3)
        out.append((p, params))
    return out


def test_no_recompilation_while_serving(engine):
    runner = engine.runner
    runner.warmup((DECODE_STEPS,))
    compiled = runner.num_compiles
    use_scheduler(engine)
    run(engine, _mixed_workload(10))
    assert runner.num_compiles == compiled, sorted(runner._compiled)
    use_scheduler(engine, num_blocks=24)  # preemption and recompute too
    run(engine, _mixed_workload(11))
    assert runner.num_compiles == compiled


def test_warmup_compiles_steps_and_sampler(engine):
    """After LLMEngine.warmup nothing compiles for greedy and sampled requests: step buckets and the sampler of
    every row bucket (runner executables and the jitted sampler's cache stay the same size)."""
    engine.warmup()
    compiled, sampler = engine.runner.num_compiles, sample_rows._cache_size()
    use_scheduler(engine)
    prompts = _random_prompts(21, [5, 40, 3, 17, 60, 9])
    run(
        engine,
        [
            (p, greedy(6) if i % 2 else SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=i))
            for i, p in enumerate(prompts)
        ],
    )
    assert engine.runner.num_compiles == compiled
    assert sample_rows._cache_size() == sampler


def test_min_tokens_with_too_many_stop_ids_is_rejected(engine):
    with pytest.raises(ValueError, match="at most 8 ids"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=tuple(range(10, 20))))
    assert not engine.has_unfinished()
    engine.add_request(
        [1, 2, 3], SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=tuple(range(10, 18)))
    )  # exactly 8: accepted
    while engine.has_unfinished():
        engine.step()


# Pallas kernels --------------------------------------------------------------------------------------------------


def test_interpret_kernels_match_reference(llm):
    """The engine through our Pallas kernels (interpret mode) on a short run, over SmolLM2's first two layers (its
    head counts, head size and vocabulary; the kernels run per layer alike, and 30 interpreted layers cost about
    half a minute of the module's time) against the contiguous reference of that same two-layer model."""
    from serving.spec.draft_model import truncated_model

    model = truncated_model(llm.model, 2)
    config = EngineConfig.from_kwargs(
        max_model_len=64,
        attention_backend="interpret",
        max_num_seqs=2,
        max_num_batched_tokens=16,
        num_kv_blocks=12,
        decode_steps=1,
        enable_prefix_caching=False,
    )
    eng = LLMEngine(model, llm.tokenizer, config)
    prompts = [MIXED_PROMPTS[2], MIXED_PROMPTS[1]]  # 7 and 3 tokens: one mixed step, then paged decode
    tracks = run(eng, [(p, greedy(4)) for p in prompts])
    ref = generate_reference(model, prompts, [dict(temperature=0.0)] * 2, [4, 4], llm.config.eos_token_ids, 64)
    for t, want in zip(tracks, ref.token_ids):
        assert t.request.output_token_ids == want


def test_logit_bias_forces_and_bans_tokens(engine, reference):
    """+100 on a token makes greedy decoding emit it every step; -100 on the greedy first token removes it; rows
    without a bias in the same batch are unchanged."""
    use_scheduler(engine, enable_prefix_caching=False)
    prompt, other = MIXED_PROMPTS[4], MIXED_PROMPTS[7]
    plain = run(engine, [(prompt, greedy(4)), (other, greedy(4))])
    first = plain[0].request.output_token_ids[0]
    forced = greedy(4, logit_bias=((42, 100.0),)).validate()
    banned = greedy(4, logit_bias=((first, -100.0),)).validate()
    tracks = run(engine, [(prompt, forced), (prompt, banned), (other, greedy(4))])
    assert tracks[0].request.output_token_ids == [42] * 4
    assert tracks[1].request.output_token_ids[0] != first
    assert tracks[2].request.output_token_ids == plain[1].request.output_token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(prompt, greedy(4, logit_bias=((10**7, 1.0),)))
    with pytest.raises(ValueError, match="logit_bias"):
        greedy(4, logit_bias=((5, 101.0),)).validate()
