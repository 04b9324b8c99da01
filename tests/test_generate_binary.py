"""serving/generate.py over a tiny random model with SmolLM2's tokenizer: the untimed warm-up compiles every shape
the timed run uses (so the printed time to first token holds no compilation), and chat on a model without a
chat template is refused with a message (LLM.chat, generate(chat=True), --chat), its built-in chat prompt skipped."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import pytest

from model.config import ModelConfig
from model.transformer import random_model
from serving import generate as gen_main


@pytest.fixture(scope="module")
def tokenizer():
    from checkpoints.loader import load_checkpoint

    return load_checkpoint().tokenizer  # the default SmolLM2's (its weights stay unread)


def _llm(tokenizer):
    from serving.engine.llm import LLM

    cfg = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, eos_token_ids=())
    options = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=8, num_kv_blocks=64, max_model_len=128)
    return LLM.from_model(random_model(cfg, jnp.float32, seed=1), tokenizer, attention_backend="xla", **options)


def test_warmup_compiles_what_the_timed_run_uses(tokenizer, monkeypatch, capsys):
    """A prompt of more than one block: the warm-up caches it, and a prefix-cache hit would schedule a step of 16
    tokens where the warm-up ran one of 32."""
    llm = _llm(tokenizer)
    compiled = []
    generate = llm.generate

    def counting(*args, **kwargs):
        before = gen_main.num_compiles(llm)
        out = generate(*args, **kwargs)
        compiled.append(gen_main.num_compiles(llm) - before)
        return out

    monkeypatch.setattr(llm, "generate", counting)
    prompts = ("The three primary colours are", "def fibonacci(n):", "Write one sentence about the sea, in English.")
    settings = gen_main.GenerateSettings(prompt=prompts, max_tokens=4, temperature=0.8)
    assert gen_main._generate_and_print(llm, settings, list(settings.prompt)) == 0
    assert len(compiled) == 2 and compiled[0] > 0 and compiled[1] == 0, compiled
    out = capsys.readouterr()
    assert out.out.count("time to first token") == 3 and "timed run compiled" not in out.err


def test_chat_without_a_template_is_refused(tokenizer, monkeypatch, capsys):
    llm, templated = _llm(dataclasses.replace(tokenizer, chat_template=None)), _llm(tokenizer)
    assert not llm.has_chat_template and templated.has_chat_template
    for call in (
        lambda: llm.chat([{"role": "user", "content": "Hi"}], max_tokens=2),
        lambda: llm.generate(["Hi"], chat=True, max_tokens=2),
    ):
        with pytest.raises(ValueError, match="has no chat template"):
            call()
    with pytest.raises(gen_main.UsageError, match="--chat: .* has no chat template"):
        gen_main._generate_and_print(llm, gen_main.GenerateSettings(prompt=("Hi",), chat=True), ["Hi"])
    generated = []  # the engine is not what these check: a stand-in records the prompts it is given

    def fake_generate(texts, **kwargs):
        generated.append(list(texts))
        return [types.SimpleNamespace(token_ids=[1], finish_reason="length", text="x", metrics={}) for _ in texts]

    monkeypatch.setattr(llm, "generate", fake_generate)
    settings = gen_main.GenerateSettings(max_tokens=2, warmup_run=False)
    assert gen_main._generate_and_print(llm, settings, gen_main.BUILTIN_PROMPTS) == 0
    assert generated == [[p for p in gen_main.BUILTIN_PROMPTS if isinstance(p, str)]]
    assert "built-in chat prompt is skipped" in capsys.readouterr().err
    monkeypatch.setattr(templated, "generate", fake_generate)
    templated.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]])
    assert generated[-1] == [templated.render_chat([{"role": "user", "content": m}]) for m in ("Hi", "Bye")]
    assert "Bye" in generated[-1][1] and generated[-1][1] != "Bye"
