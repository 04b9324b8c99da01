"""Scheduler with draft tokens (speculative verification): scheduling 1 + k tokens per decode row, budget and
length trimming, accepted / rejected updates with block rollback, stops inside accepted drafts, the prefix cache
holding only accepted tokens, drafts that never preempt, preemption of a row with drafts.

Pools are tiny (block_size 4) so block ids are exact: the free queue hands out 1, 2, 3, ... in order.
"""

import pytest

from serving.core.request import Request, RequestStatus, SamplingParams
from serving.core.scheduler import Scheduler, StepResult

BS = 4
EOS = 2


def make(num_blocks=17, budget=64, max_model_len=64, caching=False, **kw):
    return Scheduler(num_blocks, BS, 8, budget, max_model_len, enable_prefix_caching=caching, **kw)


def req(rid, prompt, max_tokens=20, **params):
    if isinstance(prompt, int):
        prompt = list(range(100, 100 + prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def step(s, sampled=None, token=7):
    """schedule + update; rows not in `sampled` get `token` when they sample."""
    out = s.schedule()
    tokens = {sr.request_id: [token] for sr in out.scheduled if sr.sample}
    tokens.update(sampled or {})
    done = s.update(StepResult.build(out, tokens))
    s.check_invariants()
    return out, done


def rows(out):
    return {sr.request_id: (sr.start_pos, sr.token_ids, sr.block_table, sr.num_draft) for sr in out.scheduled}


def test_decode_row_verifies_drafts_and_rolls_back_rejected_blocks():
    s = make()
    a = req("a", 4, logprobs=0)
    s.add_request(a)
    step(s)  # Prompt in block 1; token 7 sampled (position 4, no KV yet).
    a.spec_token_ids = [20, 21, 22, 23, 24]
    out = s.schedule()
    # Positions 4 .. 9: the last token and five drafts, in blocks 1, 2, 3; the budget counts all six.
    assert rows(out) == {"a": (4, [7, 20, 21, 22, 23, 24], [1, 2, 3], 5)} and out.num_batched_tokens == 6
    assert out.scheduled[0].sample
    done = s.update(
        StepResult.build(out, {"a": [20, 21, 30]}, logprobs={"a": [-0.1, -0.2, -0.3]})
    )  # Two accepted, then 30.
    assert done == [] and a.output_token_ids == [7, 20, 21, 30] and a.output_logprobs == [-0.1, -0.2, -0.3]
    # Valid KV: positions 4 (7), 5 (20), 6 (21); 30 is computed next step. Block 3 held only rejected drafts.
    assert (a.num_computed_tokens, a.num_tokens, a.block_ids, a.spec_token_ids) == (7, 8, [1, 2], [])
    assert s.block_manager.num_free == 14 and s.kv.num_provisional(a) == 0
    s.check_invariants()
    a.spec_token_ids = [40]
    out, _ = step(s, {"a": [40, 41]})  # All accepted: 40 and the bonus 41.
    assert rows(out) == {"a": (7, [30, 40], [1, 2, 4], 1)}  # Block 3 went to the tail of the free queue.
    assert (a.num_computed_tokens, a.output_token_ids[-3:], a.block_ids) == (9, [30, 40, 41], [1, 2, 4])
    out, _ = step(s)  # No drafts: the plain decode path.
    assert rows(out) == {"a": (9, [41], [1, 2, 4], 0)}


def test_budget_counts_drafts_and_trims_them():
    s = make(budget=8)
    for rid in "abc":
        s.add_request(req(rid, 4))
    step(s)  # a and b prefill (4 + 4 tokens); c waits.
    s.requests["a"].spec_token_ids = [5] * 9
    s.requests["b"].spec_token_ids = [6] * 3
    out, _ = step(s, {"a": [5, 5, 5, 5, 5, 5, 9], "b": [9]})
    # a (oldest) takes 1 + 6 drafts of the 8-token budget, leaving b's own token; nothing is left for b's drafts,
    # nor for c's prefill.
    assert rows(out) == {"a": (4, [7] + [5] * 6, [1, 3, 5], 6), "b": (4, [7], [2, 4], 0)}
    assert out.num_batched_tokens == 8 and s.requests["c"].status is RequestStatus.WAITING


def test_threshold_caps_tokens_per_row():
    s = make(long_prefill_token_threshold=3)
    a = req("a", 3)
    s.add_request(a)
    step(s)
    a.spec_token_ids = [5] * 6
    out, _ = step(s, {"a": [5, 9]})
    assert rows(out)["a"][3] == 2  # 1 + 2 drafts = the per-request cap.


def test_drafts_trimmed_to_max_model_len_and_max_tokens():
    s = make(max_model_len=12)
    a, b = req("a", 8), req("b", 4, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    a.spec_token_ids = [30, 31, 32, 33, 34, 35]
    b.spec_token_ids = [40, 41, 42]
    out = s.schedule()
    # Each row may still emit remaining_tokens: a, 3 before max_model_len (2 drafts and the bonus; a third draft
    # at position 11 could be accepted but its bonus never emitted); b, 1 output of max_tokens 3: one draft.
    assert rows(out) == {"a": (8, [7, 30, 31], [1, 2, 4], 2), "b": (4, [7, 40], [3, 5], 1)}
    done = s.update(StepResult.build(out, {"a": [30, 31, 32], "b": [40, 49]}))
    # Both end on their budget: a at max_model_len with the bonus 32, b at max_tokens with 49.
    assert {r.request_id: r.finish_reason for r in done} == {"a": "length", "b": "length"}
    assert a.output_token_ids == [7, 30, 31, 32] and a.num_tokens == 12 and b.output_token_ids == [7, 40, 49]
    assert s.block_manager.num_used == 0
    s.check_invariants()


def test_stop_inside_accepted_drafts_truncates():
    s = make()
    eos, min_tok, stop_id = req("eos", 4), req("min", 4, min_tokens=3), req("stopid", 4, stop_token_ids=(9,))
    for r in (eos, min_tok, stop_id):
        s.add_request(r)
    step(s)
    eos.spec_token_ids = [20, EOS, 22]
    min_tok.spec_token_ids = [EOS, 21, EOS, 23]
    stop_id.spec_token_ids = [9, 9]
    _, done = step(s, {"eos": [20, EOS, 22, 40], "min": [EOS, 21, EOS, 23, 24], "stopid": [9, 9, 5]})
    assert {r.request_id: r.finish_reason for r in done} == {"eos": "stop", "min": "stop", "stopid": "stop"}
    assert eos.output_token_ids == [7, 20, EOS]
    assert min_tok.output_token_ids == [7, EOS, 21, EOS]  # The first EOS came before min_tokens outputs.
    assert stop_id.output_token_ids == [7, 9]
    assert s.block_manager.num_used == 0 and not s.has_unfinished()


def test_prefix_cache_holds_only_accepted_tokens():
    s = make(caching=True)
    a = req("a", [100, 101, 102])
    s.add_request(a)
    step(s)  # Prompt at positions 0-2 of block 1; 7 sampled for position 3.
    a.spec_token_ids = [50, 51, 52, 53, 54]
    out, _ = step(s, {"a": [60]})  # Every draft rejected; 60 corrects the first.
    assert rows(out)["a"] == (3, [7, 50, 51, 52, 53, 54], [1, 2, 3], 5)
    assert (a.num_computed_tokens, a.block_ids) == (4, [1]) and s.cache.num_cached_blocks == 0
    a.spec_token_ids = [61, 62, 63]
    out, _ = step(s, {"a": [61, 62, 70]})  # Positions 4-7 in block 4: 60 61 62 valid, 63 rejected.
    assert rows(out)["a"] == (4, [60, 61, 62, 63], [1, 4], 3)
    assert (a.num_computed_tokens, a.num_tokens, a.block_ids) == (7, 8, [1, 4])
    b = req("b", [100, 101, 102, 7, 60, 61, 62, 70, 1])  # Would hit block 4 if its position 7 (63) were cached.
    s.add_request(b)
    s.finish("a")  # Caches a's committed full blocks: block 1 only (position 7 holds 63's KV).
    assert s.cache.cached_prefixes() == [(None, (100, 101, 102, 7), [1])]
    out, _ = step(s)
    assert rows(out)["b"][0] == 4 and b.num_cached_tokens == 4


def test_drafts_take_only_free_blocks_and_never_preempt():
    s = make(num_blocks=5)  # 4 usable.
    a, b = req("a", 4, max_tokens=12), req("b", list(range(200, 204)), max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a in block 1, b in block 2.
    b.spec_token_ids = [30, 31, 32]
    out, _ = step(s, {"a": [8], "b": [30, 31, 33]})  # a gets block 3, b block 4 (its drafts fit there).
    assert rows(out) == {"a": (4, [7], [1, 3], 0), "b": (4, [7, 30, 31, 32], [2, 4], 3)}
    assert (b.num_computed_tokens, b.block_ids) == (7, [2, 4]) and s.block_manager.num_free == 0
    b.spec_token_ids = [40, 41]  # Position 8 would need a fifth block: b runs without drafts, nobody is preempted.
    out, _ = step(s)
    assert rows(out) == {"a": (5, [8], [1, 3], 0), "b": (7, [33], [2, 4], 0)} and out.preempted_ids == []
    b.spec_token_ids = [50]
    out, _ = step(s)  # a at position 6; b (at 8) needs a block for its own token: b, the youngest, is preempted.
    assert out.preempted_ids == ["b"] and list(rows(out)) == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.spec_token_ids == []
    assert b.num_computed_tokens == 0 and s.kv.num_provisional(b) == 0
    s.check_invariants()
    while s.has_unfinished():
        step(s)
    assert s.block_manager.num_free == 4


def test_update_validates_draft_rows_before_changing_anything():
    s = make()
    a = req("a", 4)
    s.add_request(a)
    step(s)
    a.spec_token_ids = [20, 21]
    out = s.schedule()
    with pytest.raises(ValueError, match="not a prefix"):
        s.update(StepResult.build(out, {"a": [21, 5]}))
    with pytest.raises(ValueError, match="4 tokens"):
        s.update(StepResult.build(out, {"a": [20, 21, 5, 6]}))
    with pytest.raises(ValueError, match="computed=2"):
        s.update(StepResult.build(out, {"a": [20, 5]}, computed={"a": 2}))
    with pytest.raises(ValueError, match="got no token"):
        s.update(StepResult.build(out, {}))
    assert a.output_token_ids == [7] and a.num_computed_tokens == 4 and a.block_ids == [1, 2]
    s.update(StepResult.build(out, {"a": [20, 5]}))
    assert a.output_token_ids == [7, 20, 5] and a.block_ids == [1, 2]
    s.check_invariants()


def test_drafts_on_a_prefill_row_are_ignored():
    s = make(budget=4)
    a = req("a", 10)
    a.spec_token_ids = [1, 2, 3]
    s.add_request(a)
    out, _ = step(s)
    assert rows(out) == {"a": (0, [100, 101, 102, 103], [1], 0)}
    step(s)
    a.spec_token_ids = [1, 2, 3]
    out, _ = step(s)  # The last chunk (8, 9) samples, but it is not a decode row: no drafts.
    assert rows(out) == {"a": (8, [108, 109], [1, 2, 3], 0)}
