"""The public Python API: `from serving import LLM`.

llm = LLM()                                    # the embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], max_tokens=32)  # texts and token ids
logits = llm.score([1, 2, 3])                  # float32 [len, vocab]
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.loader import Checkpoint, load_checkpoint
from model.kv import NoCache
from model.transformer import Transformer, build_model
from serving.core.request import CompletionOutput
from serving.engine.engine import LLMEngine

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(dtype: Any):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return dtype


@functools.partial(nnx.jit)
def _score(model: Transformer, tokens_bt):
    t = tokens_bt.shape[1]
    return model(tokens_bt, jnp.arange(t)[None], None, NoCache(jnp.array([t])))[0]


class LLM:
    """Loads a model and generates with it.

    Args:
      model: None for the default model, or a .gguf file, an HF safetensors directory or an Orbax directory.
      dtype: "float32" or "bfloat16" compute and weights.
      max_model_len: context limit (defaults to the model's).
      **engine_options: options of the paged engine (max_num_seqs, max_num_batched_tokens, block_size,
        num_kv_blocks, enable_prefix_caching, kv_cache_memory_fraction, ...).
    """

    def __init__(
        self, model: str | None = None, *, dtype: Any = "float32", max_model_len: int | None = None, **engine_options
    ):
        t0 = time.perf_counter()
        ckpt: Checkpoint = load_checkpoint(model)
        if ckpt.tokenizer is None:
            raise ValueError(f"{ckpt.source}: checkpoint has no tokenizer")
        self.config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.dtype = parse_dtype(dtype)
        self.model = build_model(ckpt.config, ckpt.params, self.dtype)
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        self.engine_options = engine_options
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
            self._engine = LLMEngine(
                self.model, self.tokenizer, max_model_len=self.max_model_len, **self.engine_options
            )
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
        use_reference: bool = False,
        progress=None,
        **sampling,
    ) -> list[CompletionOutput]:
        """Generates a completion per prompt.

        Args:
          prompts: a string, a list of strings, or a list of token-id lists.
          max_tokens, temperature, top_p, top_k, seed: sampling controls (temperature 0 = greedy).
          chat: render each string prompt as a user turn of the chat template.
          use_reference: run the contiguous-cache reference path instead of the paged engine.
          progress: optional callable(finished, total, tokens): prompts finished, prompts in all, tokens generated
            so far; called after every engine step (the reference path calls it once, at the end).
          **sampling: further SamplingParams fields (min_p, stop, penalties, ...).

        Returns:
          One CompletionOutput per prompt, in order.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.encode_prompt(p, chat) for p in prompts]
        if use_reference:
            outs = self._generate_reference(
                texts, ids, max_tokens, temperature, top_p, top_k, seed, sampling.get("ignore_eos", False)
            )
            if progress is not None:
                progress(len(outs), len(outs), sum(len(o.token_ids) for o in outs))
            return outs
        return self.engine.generate(
            texts,
            ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            progress=progress,
            **sampling,
        )

    def _generate_reference(self, texts, ids, max_tokens, temperature, top_p, top_k, seed, ignore_eos):
        from serving.engine.reference import generate_reference

        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        rows = [dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=(seed or 0) + i) for i in range(len(ids))]
        t0 = time.perf_counter()
        stop_ids = () if ignore_eos else self.config.eos_token_ids
        out = generate_reference(self.model, ids, rows, [max_tokens] * len(ids), stop_ids, self.max_model_len)
        elapsed = time.perf_counter() - t0
        results = []
        for text, prompt_ids, gen, lps in zip(texts, ids, out.token_ids, out.logprobs):
            stopped = bool(gen) and gen[-1] in stop_ids
            results.append(
                CompletionOutput(
                    text,
                    prompt_ids,
                    self.tokenizer.decode(gen),
                    gen,
                    "stop" if stopped else "length",
                    lps,
                    {"seconds": elapsed},
                )
            )
        return results
