"""The public Python API: `from serving import LLM`.

llm = LLM()                                    # the embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], max_tokens=32)  # texts and token ids
logits = llm.score([1, 2, 3])                  # float32 [len, vocab]
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.loader import Checkpoint, load_checkpoint
from model.kv import NoCache
from model.transformer import Transformer, build_model
from serving.config import EngineConfig
from serving.core.request import CompletionOutput, SamplingParams
from serving.engine.engine import LLMEngine

_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(dtype: Any):
    if isinstance(dtype, str):
        if dtype not in _JNP_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_JNP_DTYPES)}")
        return _JNP_DTYPES[dtype]
    return dtype


@functools.partial(nnx.jit)
def _score(model: Transformer, tokens_bt):
    t = tokens_bt.shape[1]
    return model(tokens_bt, jnp.arange(t)[None], None, NoCache(jnp.array([t])))[0]


def enable_compilation_cache(directory: str) -> None:
    """Turns on JAX's persistent compilation cache in `directory` ('~' expanded; '' leaves it off), so a restarted
    process loads its step executables instead of compiling them again. Takes effect before the first compile."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


class LLM:
    """Loads a model and generates with it.

    Args:
      model: None for the default model, or a .gguf file, an HF safetensors directory or an Orbax directory.
      **options: flat EngineConfig options (serving/config.py FLAT_OPTIONS): dtype ("float32" or "bfloat16"),
        max_model_len (defaults to the model's), max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks,
        enable_prefix_caching, kv_cache_memory_fraction, attention_backend, decode_steps, policy, warmup,
        compilation_cache_dir, ... An unknown, bad or not yet supported option raises ValueError naming it.
    """

    def __init__(self, model: str | None = None, **options):
        self._load(EngineConfig.from_kwargs(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM built from a ready EngineConfig (the binaries build theirs from flags)."""
        llm = cls.__new__(cls)
        llm._load(config)
        return llm

    @classmethod
    def from_model(cls, model: Transformer, tokenizer, config: EngineConfig | None = None) -> LLM:
        """An LLM over a model already in memory (random weights in tests and benchmarks); `config.model` and
        `config.dtype` are not used (the model has its own)."""
        config = config or EngineConfig()
        enable_compilation_cache(config.compilation_cache_dir)
        llm = cls.__new__(cls)
        llm._init(model, tokenizer, config, model.cfg.name, time.perf_counter())
        return llm

    def _load(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        enable_compilation_cache(config.compilation_cache_dir)
        ckpt: Checkpoint = load_checkpoint(config.model.model)
        if ckpt.tokenizer is None:
            raise ValueError(f"{ckpt.source}: checkpoint has no tokenizer")
        model = build_model(ckpt.config, ckpt.params, parse_dtype(config.dtype))
        self._init(model, ckpt.tokenizer, config, config.model.display_name, t0)

    def _init(self, model: Transformer, tokenizer, config: EngineConfig, name: str, t0: float) -> None:
        """`name`: how clients and logs call the model (the file's base name, not the GGUF's general.name)."""
        self.model, self.config, self.tokenizer, self.dtype = model, model.cfg, tokenizer, model.dtype
        limit = self.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.engine_config = config.replace(max_model_len=self.max_model_len)
        self.name = name
        self._engine = None
        self.load_seconds = time.perf_counter() - t0

    # Helpers shared by the binaries ----------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids for a text prompt (rendered through the chat template when `chat`) or ids passed through."""
        if isinstance(prompt, str):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            ids = self.tokenizer.encode(text)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        return ids

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [len, vocab] of the model over `token_ids` (teacher forcing)."""
        ids = self.encode_prompt(list(token_ids))
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the context length {self.max_model_len}")
        return np.asarray(_score(self.model, jnp.asarray([ids], jnp.int32))[0], np.float32)

    @property
    def engine(self):
        if self._engine is None:
            self._engine = LLMEngine(self.model, self.tokenizer, self.engine_config)
        return self._engine

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        chat: bool = False,
        progress=None,
        **sampling,
    ) -> list[CompletionOutput]:
        """Generates a completion per prompt with the paged engine.

        Args:
          prompts: a string, a list of strings, or a list of token-id lists.
          max_tokens, temperature, top_p, top_k, seed: sampling controls (temperature 0 = greedy); prompt i is
            sampled with seed + i.
          chat: render each string prompt as a user turn of the chat template.
          progress: optional callable(finished, total, tokens): prompts finished, prompts in all, tokens generated
            so far; called after every engine step.
          **sampling: further SamplingParams fields (min_p, stop, stop_token_ids, penalties, min_tokens,
            ignore_eos, logprobs).

        Returns:
          One CompletionOutput per prompt, in order.

        Raises:
          ValueError: a bad prompt or sampling option (checked here, once, for the whole batch).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.encode_prompt(p, chat) for p in prompts]
        options = sampling_options(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **sampling
        )
        return self.engine.generate(texts, ids, progress=progress, **options)


def sampling_options(**options) -> dict:
    """Normalised SamplingParams keyword arguments (stop strings and ids as tuples), validated once here.

    The engine builds each prompt's SamplingParams from them (seed + i for prompt i) without validating again.
    """
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown sampling option {unknown[0]!r}; known: {', '.join(sorted(known))}")
    for key in ("stop", "stop_token_ids"):
        if key in options:
            value = options[key]
            options[key] = (value,) if isinstance(value, str) else tuple(value or ())
    SamplingParams(**options).validate()
    return options
