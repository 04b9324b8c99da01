"""Scheduler: token budget, chunked prefill, prefix hits, preemption, stops, abort, draft tokens, randomized stress.

Pools are tiny (block_size 4) so block ids are exact: the free queue hands out 1, 2, 3, ... in order.
"""

import random

import pytest

from serving.core.request import Request, RequestStatus, SamplingParams
from serving.core.scheduler import RequestRejected, Scheduler, StepResult

BS = 4
EOS = 2


def make(num_blocks=17, max_num_seqs=8, budget=64, max_model_len=64, caching=False, **kw):
    return Scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=caching,
        **kw,
    )


def req(rid, prompt, max_tokens=16, priority=0, **params):
    if isinstance(prompt, int):
        prompt = list(range(100, 100 + prompt))
    return Request(
        rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,), priority=priority
    )


def step(s, token=7, per_request=None):
    """schedule + update, sampling `token` (or per_request[id]) for every sampled row."""
    out = s.schedule()
    sampled = {}
    for sr in out.scheduled:
        if sr.sample:
            sampled[sr.request_id] = [per_request.get(sr.request_id, token) if per_request else token]
    done = s.update(StepResult.build(out, sampled))
    s.check_invariants()
    return out, done


def by_id(out):
    return {sr.request_id: sr for sr in out.scheduled}


def test_chunked_prefill_splits_a_long_prompt():
    s = make(budget=4)
    r = req("a", 10)
    s.add_request(r)
    chunks = []
    for _ in range(3):
        out, _ = step(s)
        (sr,) = out.scheduled
        chunks.append((sr.start_pos, sr.token_ids, sr.block_table, sr.sample))
    assert chunks == [
        (0, list(range(100, 104)), [1], False),
        (4, list(range(104, 108)), [1, 2], False),
        (8, [108, 109], [1, 2, 3], True),
    ]
    assert r.output_token_ids == [7] and r.num_computed_tokens == 10
    out, _ = step(s)  # Decode: the sampled token at position 10.
    (sr,) = out.scheduled
    assert (sr.start_pos, sr.token_ids, sr.block_table, sr.sample) == (10, [7], [1, 2, 3], True)


def test_budget_is_respected_across_requests():
    s = make(budget=10)
    for rid in "abc":
        s.add_request(req(rid, 4))
    out, _ = step(s)
    assert [(sr.request_id, len(sr.token_ids), sr.sample) for sr in out.scheduled] == [
        ("a", 4, True),
        ("b", 4, True),
        ("c", 2, False),
    ]
    assert out.num_batched_tokens == 10
    out, _ = step(s)
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("a", 1), ("b", 1), ("c", 2)]
    assert out.num_batched_tokens == 4


def test_decode_rows_come_before_an_older_prefill():
    s = make(budget=8, long_prefill_token_threshold=6)
    s.add_request(req("long", 20))
    s.add_request(req("short", 2))
    out, _ = step(s)
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("long", 6), ("short", 2)]
    for _ in range(2):
        out, _ = step(s)
        assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("short", 1), ("long", 6)]
    out, _ = step(s)
    assert [(sr.request_id, len(sr.token_ids), sr.sample) for sr in out.scheduled] == [
        ("short", 1, True),
        ("long", 2, True),
    ]


def test_prefill_cap_while_decoding_bounds_prompt_tokens_per_step():
    """While rows decode, prompt tokens per step (running prefills and admissions together) stay under the cap;
    with nothing decoding the whole budget is used again."""
    s = make(budget=32, max_prefill_tokens_while_decoding=5)
    s.add_request(req("a", 3, max_tokens=30))
    out, _ = step(s)  # nothing decodes yet: the prompt takes what it needs of the whole budget
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("a", 3)]
    s.add_request(req("b", 12))
    s.add_request(req("c", 4))
    seen = []
    for _ in range(4):
        out, _ = step(s)
        seen.append([(sr.request_id, len(sr.token_ids)) for sr in out.scheduled])
    assert seen == [
        [("a", 1), ("b", 5)],  # the cap, not the 31 tokens of budget left, limits b's chunk and c must wait
        [("a", 1), ("b", 5)],
        [("a", 1), ("b", 2), ("c", 3)],  # b's prompt ends, c starts within what is left of the cap
        [("a", 1), ("b", 1), ("c", 1)],
    ]
    s2 = make(budget=32)  # without the cap the same requests take the whole budget
    s2.add_request(req("a", 3, max_tokens=30))
    step(s2)
    s2.add_request(req("b", 12))
    s2.add_request(req("c", 4))
    out, _ = step(s2)
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("a", 1), ("b", 12), ("c", 4)]
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make(max_prefill_tokens_while_decoding=-1)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        make(max_prefill_tokens_while_decoding=8, enable_chunked_prefill=False)


def test_a_long_prompt_leaves_room_for_prompts_waiting_behind_it():
    """A running prompt's chunk takes prefill_share_while_waiting of the budget while a request waits that could
    start, so a short prompt arriving during a long prefill starts in the next step; alone (or with the share at
    1.0) the long prompt takes the whole budget."""
    s = make(num_blocks=40, budget=16, max_model_len=128, prefill_share_while_waiting=0.5)
    s.add_request(req("long", 100))
    out, _ = step(s)
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("long", 16)]  # alone: everything
    s.add_request(req("short", 5))
    out, _ = step(s)
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("long", 8), ("short", 5)]
    out, _ = step(s)  # nobody waits: the long prompt has the budget less the short row's decode token
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("short", 1), ("long", 15)]
    full = make(num_blocks=40, budget=16, max_model_len=128)  # the default share (1.0): the arrival waits
    full.add_request(req("long", 100))
    step(full)
    full.add_request(req("short", 5))
    out, _ = step(full)
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("long", 16)]
    with pytest.raises(ValueError, match="prefill_share_while_waiting"):
        make(prefill_share_while_waiting=0.0)


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 4))
    out, _ = step(s)
    assert sorted(by_id(out)) == ["a", "b"] and s.num_running == 2 and s.num_waiting == 1


def test_admission_blocked_until_a_request_ends_or_arrives():
    """A waiting request the last schedule could not start (here: a free slot but too few free blocks) stays
    unstartable until a running request finishes or another arrives; the engine's decode loop keys off it."""
    s = make(num_blocks=6, max_num_seqs=8)  # 5 usable blocks: one 12-token prompt (3 blocks + growth) at a time
    s.add_request(req("a", 12, max_tokens=4))
    assert not s.admission_blocked  # nothing scheduled yet
    step(s)
    assert not s.admission_blocked  # nothing waits
    s.add_request(req("b", 12, max_tokens=4))
    assert not s.admission_blocked  # a new arrival may start at the next schedule
    out, _ = step(s)
    assert list(by_id(out)) == ["a"] and s.num_waiting == 1 and s.num_running < s.max_num_seqs
    assert s.admission_blocked  # b waits for blocks, not for a slot
    while "b" not in by_id(out):
        out, done = step(s)
        if done:
            assert not s.admission_blocked  # a finished: its blocks may start b
    s.abort("b")
    assert not s.admission_blocked


def test_chunked_prefill_disabled_waits_for_budget_and_rejects_oversized():
    s = make(budget=6, enable_chunked_prefill=False)
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    out, _ = step(s)
    assert list(by_id(out)) == ["a"]  # b does not fit whole in the 2 tokens left.
    out, _ = step(s)
    assert list(by_id(out)) == ["a", "b"]
    with pytest.raises(RequestRejected, match="chunked prefill is disabled"):
        s.add_request(req("c", 7))


def test_prefix_hit_skips_computed_blocks():
    s = make(caching=True)
    a = req("a", 10, max_tokens=1)
    s.add_request(a)
    _, done = step(s)
    assert done == [a] and a.finish_reason == "length"
    # Full blocks 1, 2 (positions 0-7) are cached; the partial block 3 went back to the pool.
    assert s.cache.cached_block_ids() == [1, 2] and s.block_manager.num_used == 2
    b = req("b", list(range(100, 109)) + [55])
    s.add_request(b)
    out, _ = step(s)
    (sr,) = out.scheduled
    assert (sr.start_pos, sr.token_ids, sr.block_table, sr.sample) == (8, [108, 55], [1, 2, 4], True)
    assert b.num_cached_tokens == 8
    stats = s.stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (20, 8)
    assert stats.prefix_hit_rate == pytest.approx(0.4)


def test_prefix_hit_never_covers_the_whole_prompt():
    s = make(caching=True)
    s.add_request(req("a", 8, max_tokens=1))
    step(s)
    assert s.cache.cached_block_ids() == [1, 2]
    c = req("c", 8)  # Exactly the two cached blocks.
    s.add_request(c)
    out, _ = step(s)
    (sr,) = out.scheduled
    # The last token must be computed for logits, so only block 1 is reused; position 4.. go to a new block.
    assert (sr.start_pos, sr.block_table, sr.sample) == (4, [1, 3], True)
    assert c.num_cached_tokens == 4


def test_concurrent_requests_share_a_prompt_cached_after_prefill():
    s = make(caching=True)
    s.add_request(req("a", 9))
    step(s)  # a's prompt is computed and its full blocks 1, 2 cached while it keeps running.
    s.add_request(req("b", 9))
    out, _ = step(s)
    sr = by_id(out)["b"]
    assert sr.start_pos == 8 and sr.block_table == [1, 2, 4]
    assert s.block_manager.refcount(1) == 3  # Cache, a and b.


def test_namespaces_do_not_share_prefixes():
    s = make(caching=True)
    a = req("a", 9, max_tokens=1)
    a.cache_namespace = "adapter-1"
    s.add_request(a)
    step(s)
    b = req("b", 9)
    b.cache_namespace = "adapter-2"
    s.add_request(b)
    out, _ = step(s)
    assert out.scheduled[0].start_pos == 0


@pytest.mark.parametrize("caching", [False, True])
def test_preempts_youngest_and_resumes_it_by_recompute(caching):
    # 4 usable blocks; a and b each have 1 prompt block and grow one block per 4 decoded tokens.
    s = make(num_blocks=5, caching=caching)
    a, b = req("a", 4, max_tokens=9), req("b", list(range(200, 204)), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    for _ in range(5):  # Positions 0..7: a in blocks [1, 3], b in [2, 4].
        out, _ = step(s)
        assert not out.preempted_ids
    assert (a.block_ids, b.block_ids) == ([1, 3], [2, 4])
    out, _ = step(s)  # Both would write position 8: a (older) needs a third block and none is free.
    assert out.preempted_ids == ["b"] and list(by_id(out)) == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1 and b.block_ids == []
    assert b.num_computed_tokens == 0 and b.output_token_ids == [7] * 5  # Outputs survive.
    # b's blocks went back to the pool in order; with caching they were cached, and eviction took the LRU leaf.
    assert a.block_ids == [1, 3, 4 if caching else 2]
    while a.status is not RequestStatus.FINISHED:
        out, _ = step(s)
        assert "b" not in by_id(out)
    assert a.finish_reason == "length"
    out, _ = step(s)  # b resumes: prompt + outputs recomputed in one chunk, then sampled.
    sr = by_id(out)["b"]
    # With caching, b's first block (positions 0-3) survived in the cache.
    assert sr.start_pos == (4 if caching else 0)
    assert sr.token_ids == b.all_token_ids[sr.start_pos : 9] and sr.sample
    while s.has_unfinished():
        step(s)
    assert b.finish_reason == "length" and b.output_token_ids == [7] * 8
    if caching:
        s.cache.clear()
    assert s.block_manager.num_free == 4


def test_resumed_request_is_not_preempted_again_before_progress():
    # 7 usable blocks, prefill chunks of 4 tokens. a is the oldest and decodes throughout; c is older than b.
    s = make(num_blocks=8, budget=5, long_prefill_token_threshold=4)
    a, c, b = req("a", 4, max_tokens=20), req("c", 8, max_tokens=12), req("b", list(range(200, 212)), max_tokens=12)
    for r in (a, c, b):
        s.add_request(r)
    while b.num_preemptions == 0:
        out, _ = step(s)
    assert out.preempted_ids == ["b"]  # The youngest goes first, mid-prefill.
    while c.status is not RequestStatus.PREEMPTED:
        out, _ = step(s)
    assert out.preempted_ids == ["c"]
    out, _ = step(s)
    assert list(by_id(out)) == ["a"]  # c heads the queue but its 15 tokens do not fit; b waits behind it.
    s.abort("c")  # b resumes next step, recomputing its 12-token prompt.
    window = []
    while not b.output_token_ids:  # Until b samples its first token.
        out, _ = step(s)
        window.append([(sr.request_id, sr.start_pos) for sr in out.scheduled] + out.preempted_ids)
        assert "b" not in out.preempted_ids
    # b computes two chunks, then a takes the last free block; b waits (keeping its blocks) instead of being
    # preempted again, until a needs yet another block and, b being protected, a yields.
    assert window == [
        [("a", 14), ("b", 0)],
        [("a", 15), ("b", 4)],
        [("a", 16)],
        [("a", 17)],
        [("a", 18)],
        [("a", 19)],
        [("b", 8), "a"],
    ]
    assert b.num_preemptions == 1 and a.num_preemptions == 1
    while s.has_unfinished():
        step(s)
    assert (a.finish_reason, b.finish_reason) == ("length", "length")


def test_request_that_can_never_fit_is_rejected_at_add():
    s = make(num_blocks=5, max_model_len=64)  # 4 blocks = 16 positions.
    too_long = req("x", 65)
    with pytest.raises(RequestRejected, match="longer than max_model_len=64"):
        s.add_request(too_long)
    assert too_long.status is RequestStatus.FINISHED and too_long.finish_reason == "error"
    assert "max_model_len" in too_long.finish_message
    with pytest.raises(RequestRejected, match="KV blocks"):
        s.add_request(req("y", 17, max_tokens=1))
    with pytest.raises(RequestRejected, match="KV blocks"):
        s.add_request(req("z", 8, max_tokens=10))  # 17 positions at most.
    s.add_request(req("ok", 8, max_tokens=9))  # 16 positions: fits exactly.
    with pytest.raises(RequestRejected, match="empty prompt"):
        s.add_request(req("e", []))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(req("ok", 4))
    assert s.has_unfinished() is not False and s.num_waiting == 1


@pytest.mark.parametrize("caching", [False, True])
def test_abort_frees_blocks_in_every_state(caching):
    s = make(num_blocks=8, budget=4, caching=caching)
    s.add_request(req("waiting", 4))
    assert s.abort("waiting").finish_reason == "abort"
    s.add_request(req("prefill", 10, max_tokens=4))
    step(s)
    assert s.abort("prefill").status is RequestStatus.FINISHED  # Mid-prefill.
    s.add_request(req("decode", 4))
    step(s)
    step(s)
    s.abort("decode")
    assert s.abort("unknown") is None
    # Preempted: p1 (older) grows into p2's block.
    s.add_request(req("p1", 8, max_tokens=12))
    s.add_request(req("p2", list(range(200, 208)), max_tokens=12))
    for _ in range(30):
        step(s)
        if s.requests["p2"].status is RequestStatus.PREEMPTED:
            break
    assert s.requests["p2"].status is RequestStatus.PREEMPTED
    s.abort("p2")
    s.abort("p1")
    s.check_invariants()
    assert not s.has_unfinished()
    held = s.cache.num_cached_blocks if caching else 0
    assert s.block_manager.num_used == held
    if caching:
        s.cache.clear()
    assert s.block_manager.num_free == 7


def test_stop_conditions():
    s = make()
    s.add_request(req("eos", 4))
    s.add_request(req("ignore", 4, ignore_eos=True, max_tokens=2))
    s.add_request(req("stopid", 4, stop_token_ids=(9,)))
    s.add_request(req("min", 4, min_tokens=2))
    _, done = step(s, token=EOS, per_request={"stopid": 9})
    assert {r.request_id: r.finish_reason for r in done} == {"eos": "stop", "stopid": "stop"}
    _, done = step(s, token=EOS)
    assert {r.request_id: r.finish_reason for r in done} == {"ignore": "length", "min": "stop"}
    assert s.block_manager.num_used == 0


def test_max_model_len_stops_with_length():
    s = make(max_model_len=6)
    r = req("a", 4, max_tokens=10)
    s.add_request(r)
    step(s)
    _, done = step(s)
    assert done == [r] and r.finish_reason == "length" and r.num_tokens == 6


def test_update_appends_several_tokens_and_stops_midway():
    s = make()
    r = req("a", 4, max_tokens=10)
    s.add_request(r)
    out = s.schedule()
    s.update(StepResult.build(out, {"a": [5, 6, 7]}, logprobs={"a": [-0.1, -0.2, -0.3]}))
    assert r.output_token_ids == [5, 6, 7] and r.output_logprobs == [-0.1, -0.2, -0.3]
    out = s.schedule()
    (sr,) = out.scheduled
    assert (sr.start_pos, sr.token_ids, sr.sample) == (4, [5, 6, 7], True)  # Same path as a prefill chunk.
    done = s.update(StepResult.build(out, {"a": [8, EOS, 9]}))
    assert done == [r] and r.output_token_ids == [5, 6, 7, 8, EOS]
    s.check_invariants()


def _first_stop_one_by_one(req, tokens, max_model_len):
    """The rule token by token, as update() applied it before its one-pass Request.first_stop."""
    p, n0, t0 = req.sampling_params, req.num_output_tokens, req.num_tokens
    for j, token in enumerate(tokens):
        n, t = n0 + j + 1, t0 + j + 1
        if n >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids)):
            return j + 1, "stop"
        if n >= p.max_tokens or t >= max_model_len:
            return j + 1, "length"
    return len(tokens), None


def test_first_stop_matches_the_token_by_token_rule():
    rng = random.Random(0)
    for _ in range(3000):
        params = dict(
            max_tokens=rng.randint(1, 12),
            min_tokens=rng.randint(0, 6),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=tuple(rng.sample(range(3, 8), rng.randint(0, 2))),
        )
        params["min_tokens"] = min(params["min_tokens"], params["max_tokens"])
        r = req("a", rng.randint(1, 8), **params)
        r.extend_output([rng.randint(10, 12) for _ in range(rng.randint(0, params["max_tokens"] - 1))])
        tokens = [rng.choice([EOS, 3, 4, 5, 6, 7, 11]) for _ in range(rng.randint(0, 9))]
        assert r.first_stop(tokens, 24) == _first_stop_one_by_one(r, tokens, 24), (params, r.output_token_ids, tokens)


def test_update_rejects_missing_or_misplaced_tokens():
    s = make(budget=2)
    s.add_request(req("a", 4))
    out = s.schedule()
    with pytest.raises(ValueError, match="non-final prefill chunk"):
        s.update(StepResult.build(out, {"a": [1]}))
    s2 = make()
    s2.add_request(req("a", 4))
    with pytest.raises(ValueError, match="got no token"):
        s2.update(StepResult.build(s2.schedule(), {}))


def test_engine_finish_for_stop_string_and_abort_between_schedule_and_update():
    s = make()
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    step(s)
    r = s.finish("a", "stop")
    assert r.finish_reason == "stop" and r.block_ids == [] and not s.requests.get("a")
    out = s.schedule()
    s.abort("b")
    assert s.update(StepResult.build(out, {"b": [7]})) == []  # Ignored: b is gone.
    s.check_invariants()
    assert s.block_manager.num_used == 0


def test_priority_policy_admits_by_priority_then_arrival():
    s = make(max_num_seqs=2, policy="priority")
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("high", 4, priority=0))
    s.add_request(req("mid", 4, priority=1))
    out, _ = step(s)
    assert sorted(by_id(out)) == ["high", "mid"]


def test_allocation_evicts_least_recently_used_cache_blocks_only_as_needed():
    s = make(num_blocks=9, caching=True)  # 8 usable blocks.
    for rid, base in (("old", 100), ("new", 300)):
        s.add_request(req(rid, list(range(base, base + 16)), max_tokens=1))
        step(s)
    assert s.block_manager.num_free == 0 and s.cache.num_cached_blocks == 8  # Blocks 1-4 old, 5-8 new.
    s.add_request(req("x", list(range(500, 509)), max_tokens=1))  # Needs 3 blocks.
    out, _ = step(s)
    # The three tail blocks of the least recently used sequence go; its first block stays cached.
    assert by_id(out)["x"].block_table == [2, 3, 4]
    # x finished at once: its two full blocks are cached now, its partial block 4 is free.
    assert sorted(s.cache.cached_block_ids()) == [1, 2, 3, 5, 6, 7, 8] and s.block_manager.num_free == 1
    assert s.cache.match_prefix(list(range(100, 116))).block_ids == [1]
    assert s.cache.match_prefix(list(range(300, 316))).block_ids == [5, 6, 7, 8]


@pytest.mark.parametrize("caching", [False, True])
def test_multi_step_decode_with_lookahead(caching):
    s = make(caching=caching)
    a = req("a", 6, max_tokens=20)
    s.add_request(a)
    step(s)  # Prompt in blocks [1, 2]; one token sampled.
    out = s.schedule()
    (sr,) = out.scheduled
    cow = []
    assert s.reserve_lookahead([a], 7, cow) and cow == []
    assert sr.block_table == [1, 2] and a.block_ids == [1, 2, 3, 4]  # Positions up to 6 + 1 + 7 - 1 = 13.
    s.update(StepResult.build(out, {"a": [10 + i for i in range(8)]}, computed={"a": 8}))
    assert a.num_computed_tokens == 14 and a.num_tokens == 15  # The last sampled token still needs its KV.
    s.check_invariants()
    out = s.schedule()
    assert s.reserve_lookahead([a], 4, cow)
    with pytest.raises(ValueError, match="computed=9"):
        s.update(StepResult.build(out, {"a": [1, 2, 3, 4, 5]}, computed={"a": 9}))
    out = s.schedule()
    # EOS third of five: KV written for the two tokens after it is dropped with them.
    done = s.update(StepResult.build(out, {"a": [30, 31, EOS, 33, 34]}, computed={"a": 5}))
    assert done == [a] and a.output_token_ids[-3:] == [30, 31, EOS] and a.num_computed_tokens == a.num_tokens
    s.check_invariants()
    if caching:
        assert len(s.cache.cached_block_ids()) == a.num_tokens // BS
        s.cache.clear()
    assert s.block_manager.num_free == 16


def test_lookahead_never_preempts():
    s = make(num_blocks=4)  # 3 usable blocks.
    a = req("a", 4, max_tokens=8)
    s.add_request(a)
    step(s)
    out = s.schedule()
    cow = []
    assert not s.reserve_lookahead([a], 8, cow)  # Would need 4 blocks.
    assert s.reserve_lookahead([a], 7, cow) and len(a.block_ids) == 3
    s.update(StepResult.build(out, {"a": [7]}))  # A single step after all; the extra blocks stay with a.
    s.check_invariants()


def test_sampling_params_validation():
    assert SamplingParams().validate() == SamplingParams()
    bad = [
        dict(max_tokens=0),
        dict(max_tokens=-1),
        dict(temperature=-0.5),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(min_p=2.0),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=3.0),
        dict(frequency_penalty=-2.5),
        dict(seed=1.5),
        dict(stop=["x"]),
        dict(stop=("",)),
        dict(stop_token_ids=(-1,)),
        dict(min_tokens=20),
        dict(logprobs=-1),
    ]
    for kwargs in bad:
        (name,) = kwargs
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs).validate()


def test_request_token_bookkeeping():
    r = Request("r", [1, 2, 3])
    assert r.num_tokens == 3 and r.num_prompt_tokens == 3 and r.status is RequestStatus.WAITING
    r.append_output(9, logprob=-1.0)
    assert r.all_token_ids == [1, 2, 3, 9] and r.output_token_ids == [9] and r.output_logprobs == [-1.0]
    assert r.num_tokens == 4 and r.num_output_tokens == 1 and r.prompt_token_ids == (1, 2, 3)


def _random_prompt(rng, prefixes):
    prefix = rng.choice(prefixes)
    return prefix[: rng.randint(0, len(prefix))] + [rng.randint(3, 40) for _ in range(rng.randint(1, 14))]


class FakeKV:
    """A simulated device KV pool: slot -> the token prefix whose last position's KV it holds (KV at position p
    depends on tokens 0..p). The runner's writes and page copies are replayed, so stale or rejected-draft KV
    that a request or the prefix cache counted as valid is caught."""

    def __init__(self):
        self.slots = {}

    def run(self, out, rows):
        """Copies out.cow_pairs pages, then writes rows: (sequence, start, n, block table)."""
        for src, dst in out.cow_pairs:
            for j in range(BS):
                self.slots[dst * BS + j] = self.slots.get(src * BS + j)
        for seq, start, n, table in rows:
            for p in range(start, start + n):
                self.slots[table[p // BS] * BS + p % BS] = tuple(seq[: p + 1])

    def check(self, s):
        for r in s.running:
            for p in range(r.num_computed_tokens):
                got = self.slots.get(r.block_ids[p // BS] * BS + p % BS)
                assert got == tuple(r.all_token_ids[: p + 1]), f"{r.request_id}: stale KV at position {p}"
        for _, tokens, blocks in s.cache.cached_prefixes() if s.cache else ():
            for p in range(len(tokens)):
                assert self.slots.get(blocks[p // BS] * BS + p % BS) == tokens[: p + 1], f"cached KV at {p}"


def _set_drafts(s, rng):
    """The engine's part: random drafts on some running requests (decode rows use them, prefills must not)."""
    for r in s.running:
        if rng.random() < 0.5:
            r.spec_token_ids = [EOS if rng.random() < 0.05 else rng.randint(3, 40) for _ in range(rng.randint(0, 5))]


def _verify(sr, rng):
    """Tokens the verifier returns for a draft row: a random prefix of the drafts, then a bonus/correction."""
    accepted = rng.randint(0, sr.num_draft)
    return sr.token_ids[1 : 1 + accepted] + [EOS if rng.random() < 0.08 else rng.randint(3, 40)]


@pytest.mark.parametrize(
    "seed,caching,policy", [(seed, seed % 3 != 1, ("fcfs", "priority")[seed % 2]) for seed in range(16)]
)
def test_randomized_stress_no_leaks(seed, caching, policy):
    rng = random.Random(seed)
    threshold = rng.choice([0, 5])
    s = Scheduler(
        num_blocks=rng.choice([9, 11, 13]),
        block_size=BS,
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([6, 16, 40]),
        max_model_len=32,
        enable_prefix_caching=caching,
        policy=policy,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=bool(threshold) or rng.random() < 0.5,
        max_prefill_tokens_while_decoding=rng.choice([0, 3]) if threshold else 0,
    )
    prefixes = [[rng.randint(3, 40) for _ in range(16)] for _ in range(3)]
    fallback_steps = []
    schedule_running = s._schedule_running

    def spy(out, scheduled, protect):  # Records steps that dropped protection (all running protected, blocked).
        if not protect:
            fallback_steps.append(out)
        schedule_running(out, scheduled, protect)

    s._schedule_running = spy
    kv = FakeKV()
    next_id, preemptions, finished, drafts, accepted, repeats = 0, 0, 0, 0, 0, 0
    outputs_at_preemption = {}
    for _ in range(1000):
        op = rng.random()
        if op < 0.25:
            r = Request(
                f"r{next_id}",
                _random_prompt(rng, prefixes),
                SamplingParams(
                    max_tokens=rng.randint(1, 12), min_tokens=rng.choice([0, 0, 2]), ignore_eos=rng.random() < 0.2
                ),
                eos_token_ids=(EOS,),
                priority=rng.randint(0, 3),
            )
            next_id += 1
            try:
                s.add_request(r)
            except RequestRejected:
                assert r.finish_reason == "error"
        elif op < 0.3 and s.requests:
            s.abort(rng.choice(sorted(s.requests)))
        elif op < 0.33 and s.running:
            s.finish(rng.choice(s.running).request_id, "stop")
        _set_drafts(s, rng)
        out = s.schedule()
        assert out.num_batched_tokens <= s.max_num_batched_tokens
        assert out.num_batched_tokens == sum(len(sr.token_ids) for sr in out.scheduled)
        for sr in out.scheduled:
            assert len(sr.block_table) >= -(-(sr.start_pos + len(sr.token_ids)) // BS)  # More after a lookahead.
            assert 0 not in sr.block_table
            assert sr.token_ids[len(sr.token_ids) - sr.num_draft :] == sr.request.spec_token_ids[: sr.num_draft]
            assert sr.start_pos + len(sr.token_ids) <= s.max_model_len
        computed = None
        plain = all(sr.sample and len(sr.token_ids) == 1 for sr in out.scheduled)
        if out.scheduled and plain and rng.random() < 0.3:
            k = rng.randint(2, 4)  # Multi-step decode loop.
            if s.reserve_lookahead([sr.request for sr in out.scheduled], k - 1, out.cow_pairs):
                computed = {sr.request_id: k for sr in out.scheduled}
        sampled = {}
        for sr in out.scheduled:
            if sr.num_draft:
                sampled[sr.request_id] = _verify(sr, rng)
                drafts, accepted = drafts + sr.num_draft, accepted + len(sampled[sr.request_id]) - 1
            elif sr.sample:
                n = computed[sr.request_id] if computed else rng.choice([1, 1, 1, 3])
                sampled[sr.request_id] = [EOS if rng.random() < 0.08 else rng.randint(3, 40) for _ in range(n)]
        rows = []  # What the runner writes: the scheduled tokens (drafts too), a loop's sampled tokens.
        for sr in out.scheduled:
            seq = sr.request.all_token_ids[: sr.start_pos] + sr.token_ids
            n = len(sr.token_ids)
            if computed:
                seq, n = seq + sampled[sr.request_id], computed[sr.request_id]
            rows.append((seq, sr.start_pos, n, sr.request.block_ids if computed else sr.block_table))
        kv.run(out, rows)
        if rng.random() < 0.1 and s.requests:
            s.abort(rng.choice(sorted(s.requests)))  # Between schedule and update.
        finished += len(s.update(StepResult.build(out, sampled, computed=computed)))
        preemptions += len(out.preempted_ids)
        for rid in out.preempted_ids:
            r = s.requests.get(rid)
            if r is not None and outputs_at_preemption.get(rid) == r.num_output_tokens:
                # Preempted again without a new token since its last preemption: only the all-protected fallback.
                assert fallback_steps and fallback_steps[-1] is out, f"{rid} re-preempted before progress"
                repeats += 1
            if r is not None:
                outputs_at_preemption[rid] = r.num_output_tokens
        s.check_invariants()
        kv.check(s)
        for sr in out.scheduled:  # A verified row keeps no block past its accepted positions, and no drafts.
            if sr.num_draft and sr.request.status is RequestStatus.RUNNING:
                r = sr.request
                assert len(r.block_ids) == -(-r.num_computed_tokens // BS) and r.spec_token_ids == []
    while s.has_unfinished():  # Drain: everything must finish.
        out, done = step(s, token=rng.randint(3, 40))
        assert out.scheduled
        finished += len(done)
    s.check_invariants()
    print(f"finished={finished} preemptions={preemptions} repeats={repeats} drafts={drafts}/{accepted} {s.stats()}")
    assert finished > 20 and preemptions > 0 and drafts > 0 and 0 < accepted < drafts
    cached = s.cache.num_cached_blocks if caching else 0
    assert s.block_manager.num_used == cached
    if caching:
        s.cache.clear()
        assert s.cache.num_cached_blocks == 0
    assert s.block_manager.num_free == s.block_manager.num_usable_blocks
    s.check_invariants()
