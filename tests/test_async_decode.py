"""One step per token with async scheduling (tiny model, CPU): each one-step loop launched from the previous one's
tokens on the device and read one step late, its inputs patched from the last loop's (a persistent batch), gives
the tokens of host-sampled single steps and of multi-step loops; a row that stops (max_tokens at different
lengths, a stop id, a stop string found in the text one step late) emits nothing past its stop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.engine.engine import LLMEngine

CFG = ModelConfig.preset("tiny")


class _Detok:
    def __init__(self):
        self.ids: list[int] = []

    def add(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        return "".join(f"<{int(i)}>" for i in new_ids)

    def flush(self) -> str:
        return ""


class _Tokenizer:  # each token's text is "<id>": stop strings name tokens
    def detokenizer(self):
        return _Detok()


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, jnp.float32)


@pytest.fixture(scope="module")
def host(model):  # host-sampled single steps
    return _engine(model, 1, False)


@pytest.fixture(scope="module")
def chained(model):  # one step per token, async
    return _engine(model, 1, True)


def _engine(model, decode_steps: int, overlap: bool) -> LLMEngine:
    config = EngineConfig.from_kwargs(
        max_model_len=96, max_num_seqs=4, max_num_batched_tokens=128, block_size=8, decode_steps=decode_steps,
        async_scheduling=overlap, enable_prefix_caching=False, warmup=False, compilation_cache_dir="",
    )  # fmt: skip
    return LLMEngine(model, _Tokenizer(), config)


def _run(engine: LLMEngine, prompts, params) -> list:
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            streamed[o.request_id] += o.new_token_ids
    engine.step()  # nothing in flight is left behind
    outs = [engine.pop_finished(r) for r in rids]
    for r, t in zip(rids, outs):
        assert streamed[r] == t.request.output_token_ids  # every token streamed once, none past the stop
    return [(t.request.output_token_ids, t.request.finish_reason, t.text) for t in outs]


def test_one_step_loops_match_host_steps_and_multi_step_loops(model, host, chained):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, CFG.vocab_size, n).tolist() for n in (5, 11, 3, 17)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 9, 21, 40)]
    got = _run(chained, prompts, params)
    assert chained.num_decode_loops > 0 and chained.loops.num_chained > 0
    assert [len(t) for t, _, _ in got] == [30, 9, 21, 40]  # rows finishing at their own lengths, blocks grown
    assert got == _run(host, prompts, params)
    assert got == _run(_engine(model, 4, True), prompts, params)  # four-step loops, chained


def test_stops_one_step_late_emit_nothing_past_the_stop(host, chained):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, CFG.vocab_size, 7).tolist() for _ in range(3)]
    free = _run(host, prompts, [SamplingParams(max_tokens=24, temperature=0.0)] * 3)
    tokens = free[0][0]
    stop_id, stop_text = tokens[6], tokens[4]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,)),
        SamplingParams(max_tokens=24, temperature=0.0, stop=(f"<{stop_text}>",)),
        SamplingParams(max_tokens=24, temperature=0.0),
    ]
    got = _run(chained, [prompts[0]] * 2 + [prompts[2]], params)
    assert got == _run(host, [prompts[0]] * 2 + [prompts[2]], params)
    (by_id, reason_id, _), (by_text, reason_text, text) = got[:2]
    assert by_id == tokens[: tokens.index(stop_id) + 1] and reason_id == "stop"
    assert by_text == tokens[: tokens.index(stop_text) + 1] and reason_text == "stop"
    assert f"<{stop_text}>" not in text
