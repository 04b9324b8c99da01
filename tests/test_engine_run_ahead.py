"""A long prompt's chunks sample nothing, so their steps return before the device has run them: the engine keeps at
most one of them queued behind the one running, so that a request arriving during the prefill starts within a step
or two (the scheduler then gives it room: prefill_share_while_waiting), not after every chunk already queued."""

import jax
import jax.numpy as jnp

from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.engine.engine import LLMEngine


def test_prompt_chunks_run_at_most_one_step_ahead_of_the_device(monkeypatch):
    cfg = ModelConfig.tiny(max_position_embeddings=1024)
    config = EngineConfig.from_kwargs(
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_kv_blocks=80,
        attention_backend="xla",
        warmup=False,
        compilation_cache_dir="",
    )
    engine = LLMEngine(random_model(cfg, jnp.float32), NullTokenizer(), config)
    dispatched = []
    forward = engine.runner.forward

    def recorded(rows):
        dispatched.append(forward(rows))
        return dispatched[-1]

    monkeypatch.setattr(engine.runner, "forward", recorded)
    waited = []
    block = jax.block_until_ready

    def spy(x):
        waited.append(x)
        return block(x)

    monkeypatch.setattr(jax, "block_until_ready", spy)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(10, 650)), params, request_id="long")  # 10 chunks of 64
    for n in range(1, 6):
        engine.step()
        assert len(dispatched) == n
        # when step n returns, the host has waited for step n - 1: it is at most one chunk ahead of the device
        assert [id(x) for x in waited] == [id(x) for x in dispatched[: n - 1]]
    engine.add_request([5, 6, 7], params, request_id="short")
    engine.step()
    rows = engine.scheduler.requests["short"].num_computed_tokens
    assert rows == 3  # started in the first step after it arrived, beside the long prompt's chunk
