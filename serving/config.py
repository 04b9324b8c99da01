"""The engine's configuration: one tree of frozen dataclasses, validated once, with no JAX and no I/O.

    LLM(model, **flat) / absl flags (serving/flags.py)
        --> EngineConfig.from_kwargs(**flat)          one flat name per option (the names users pass to LLM)
              .model        ModelOptions         model, dtype, max_model_len
              .cache        CacheConfig          block_size, num_kv_blocks, kv_cache_memory_fraction, kv_cache_dtype
              .scheduler    SchedulerConfig      max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
                                                 policy, decode_steps, async_scheduling
              .parallel     ParallelConfig       data/tensor/pipeline/expert_parallel_size -> dp, tp, pp, ep
              .speculative  SpeculativeConfig    speculative_method, num_speculative_tokens, speculative_model,
                                                 speculative_batch_threshold, speculative_draft_layers
              .quantization QuantizationConfig   quantization
              .runtime      RuntimeConfig        attention_backend, warmup, compilation_cache_dir
        --> LLMEngine(model, tokenizer, config)

Every `__post_init__` checks its own fields; EngineConfig checks what spans sections. A bad value, an unknown
option or a contradiction raises ValueError naming the flat option. Options for features that are not built
yet are refused ("... is not supported yet"), never ignored: each refusal is one `_not_supported_yet` line,
to delete when the feature lands.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from model.quant_formats import CALIBRATED_QUANTIZATIONS, QUANTIZATIONS  # noqa: F401 - the options' names
from sharding.config import ParallelConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_COMPILATION_CACHE_DIR = os.path.join("~", ".cache", "pallas-serve", "xla")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on an accelerator, float32 on a CPU
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("ngram", "draft", "self", "medusa")
# "gguf": no quantisation at load; a GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights stay as stored (int8 / int4 group 32)
KEEP_GGUF = "gguf"
QUANTIZATION_CHOICES = (*QUANTIZATIONS, KEEP_GGUF)
# Methods whose weights the Hopper streaming kernel reads faster than XLA (H200): int8 / fp8 W8A16, and int4 (0.7-0.9
# TB/s of int4 bytes against XLA's dequantise-then-dot 0.27). W8A8 activations are quantised per call: not these.
STREAM_LAYOUT_METHODS = ("int8", "fp8", "int4_rtn", "int4_awq", "int4_gptq")
ATTENTION_BACKENDS = ("mosaic_gpu", "triton", "interpret", "xla")  # pallas_kernels.backend.BACKENDS
CPU_MAX_NUM_SEQS = 16  # max_num_seqs left unset, where memory is not measured per device (serving/engine/kv_pool.py)


def _not_supported_yet(option: str, value: Any) -> None:
    raise ValueError(f"{option}={value!r} is not supported yet")


def _check(ok: bool, option: str, value: Any, requirement: str) -> None:
    if not ok:
        raise ValueError(f"{option} must be {requirement}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(option: str, value: Any, minimum: int) -> None:
    _check(_is_int(value) and value >= minimum, option, value, f"an integer >= {minimum}")


def _check_choice(option: str, value: Any, choices: tuple) -> None:
    _check(value in choices, option, value, f"one of {', '.join(map(repr, choices))}")


def _dtype_name(dtype: Any) -> Any:
    """'bfloat16' for the string, jnp.bfloat16 or np.dtype('bfloat16'); other values pass through (and fail)."""
    if isinstance(dtype, str):
        return dtype
    return getattr(dtype, "name", None) or getattr(dtype, "__name__", dtype)


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which model, in which dtype, and its context limit.

    Attributes:
        model: None for the embedded default, or a .gguf file, an HF safetensors directory or an Orbax directory.
        dtype: weights and compute dtype name (a jnp dtype is accepted and stored by name); "auto" (the default):
            bfloat16 on a GPU or TPU, float32 on a CPU (serving.engine.llm.parse_dtype decides, where JAX is).
        max_model_len: longest prompt + output; None: the model's own limit.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        _check(self.model is None or isinstance(self.model, str), "model", self.model, "a path or None")
        _check_choice("dtype", self.dtype, DTYPES)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)

    @property
    def display_name(self) -> str:
        """A clean model name for clients and logs: the file or directory's base name (never GGUF metadata)."""
        if self.model in (None, "", "default"):
            return DEFAULT_MODEL_NAME
        base = os.path.basename(os.path.normpath(self.model))
        return base.removesuffix(".gguf")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool.

    Attributes:
        block_size: tokens per KV block; a power of two (the paged attention kernels require it).
        num_kv_blocks: blocks in the pool; None sizes the pool from free device memory.
        kv_cache_memory_fraction: share of free device memory for the pool, when num_kv_blocks is None.
        kv_cache_dtype: "auto" (the model's dtype), "int8" or "fp8" (e4m3): quantised pages with one float32 scale
            per token per KV head (model/kv.py), about half the bytes of bf16 pages.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.85
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        _check_int("block_size", self.block_size, 1)
        _check(self.block_size & (self.block_size - 1) == 0, "block_size", self.block_size, "a power of two")
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 2)  # block 0 is the null page
        f = self.kv_cache_memory_fraction
        _check(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1,
            "kv_cache_memory_fraction",
            f,
            "in (0, 1]",
        )
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_seqs: most sequences running together; None: chosen by the engine from the accelerator's memory and
            the model (serving/engine/kv_pool.py default_max_num_seqs: the sequences of 2,048 tokens the KV pool
            holds, 16 to 1,024), 16 on a CPU host.
        max_num_batched_tokens: token budget of one engine step; at least max_num_seqs, since every running
            sequence needs one token of it per decode step. None: max(max_num_seqs, 2,048) on an accelerator,
            max(max_num_seqs, 256) on a CPU host.
        enable_prefix_caching: share the KV of common prompt prefixes (radix cache).
        policy: "fcfs" (arrival order) or "priority" (lower priority value first).
        decode_steps: decode iterations per on-device loop when no request needs the host between tokens. None: 1
            on a CPU host (every token streamed when its step ends) and 8 on an accelerator, where one step per
            token still costs 1.5-1.8x the time per token of 8-step loops (BENCHMARKS.md, decode latency).
        async_scheduling: launch the next decode loop before the host applies the current one, so the device
            does not wait while the host postprocesses (serving/engine/decode_loop.py); results are identical.
        max_prefill_tokens_while_decoding: prompt tokens one step carries in all while sequences decode (0: the
            whole max_num_batched_tokens). A step with an 8,192-token chunk takes ~250 ms at 8B shape on an H200 and
            every decoding sequence waits for it; a cap of a few hundred bounds inter-token latency under load at
            the cost of slower prompt intake.
        prefill_share_while_waiting: the share of a step's token budget one running prompt's chunk may take while
            requests wait to start (1.0: all of it). A long prompt then leaves room in every step for the prompts
            that arrive behind it, instead of holding them until its whole prefill is done.
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    decode_steps: int | None = None
    async_scheduling: bool = True
    max_prefill_tokens_while_decoding: int = 0
    prefill_share_while_waiting: float = 0.5

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if None not in (self.max_num_seqs, self.max_num_batched_tokens) and (
            self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs={self.max_num_seqs}: "
                "a step could not give every running sequence its decode token"
            )
        _check(
            isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", self.enable_prefix_caching, "a bool"
        )
        _check_choice("policy", self.policy, POLICIES)
        if self.decode_steps is not None:
            _check_int("decode_steps", self.decode_steps, 1)
        _check(isinstance(self.async_scheduling, bool), "async_scheduling", self.async_scheduling, "a bool")
        _check_int("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding, 0)
        share = self.prefill_share_while_waiting
        _check(
            isinstance(share, (int, float)) and not isinstance(share, bool) and 0.0 < share <= 1.0,
            "prefill_share_while_waiting",
            share,
            "a number in (0, 1]",
        )


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (serving/spec/verify.py); off by default.

    Attributes:
        method: None (off), "ngram" (prompt lookup), "draft" (a draft model sharing the tokenizer), "self" (the
            target's first layers + its head) or "medusa" (heads trained by serving/train_heads.py on the
            target's last hidden state).
        num_speculative_tokens: the most tokens proposed per row and step (>= 1 with a method, 0 without); the
            adaptive policy picks k per request from its acceptance (tiers 1/3/5/7 up to this).
        speculative_model: the draft model's path (method "draft"), or the heads checkpoint directory (method
            "medusa"; read when the engine starts).
        speculative_batch_threshold: speculate only while fewer than this many sequences run (k shrinks
            geometrically on the way there, serving/spec/policy.py); 0: at any batch size.
        speculative_draft_layers: layers of the target the "self" draft runs (0: half of them; method "self" only).
        device_loop: draft, verify and accept inside the on-device decode loop (serving/spec/device_loop.py) when
            every row could loop; False: one host round trip per verify pass.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    speculative_model: str | None = None
    speculative_batch_threshold: int = 0
    speculative_draft_layers: int = 0
    device_loop: bool = True

    def __post_init__(self):
        if self.method is not None:
            _check_choice("speculative_method", self.method, SPECULATIVE_METHODS)
        if self.method is not None and self.num_speculative_tokens == 0:
            raise ValueError(f"speculative_method={self.method!r} needs num_speculative_tokens >= 1")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1 if self.method else 0)
        _check_int("speculative_batch_threshold", self.speculative_batch_threshold, 0)
        _check_int("speculative_draft_layers", self.speculative_draft_layers, 0)
        for option in ("num_speculative_tokens", "speculative_batch_threshold"):
            if self.method is None and getattr(self, option):
                raise ValueError(f"{option} needs speculative_method (speculative decoding is off)")
        if (self.speculative_model is not None) != (self.method in ("draft", "medusa")):
            raise ValueError("speculative_model is needed by, and only by, speculative_method='draft' or 'medusa'")
        if self.speculative_draft_layers and self.method != "self":
            raise ValueError("speculative_draft_layers needs speculative_method='self'")
        _check(isinstance(self.device_loop, bool), "speculative_device_loop", self.device_loop, "a bool")
        if not self.device_loop and self.method is None:
            raise ValueError("speculative_device_loop=False needs speculative_method (speculative decoding is off)")


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Weight (and activation) quantisation, done at load (serving/engine/quantize.py).

    Attributes:
        method: None (the checkpoint's dtype, or the checkpoint's own quantised format), one of QUANTIZATIONS, or
            "gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights kept as they are stored (int8 / int4 group 32,
            Q4_1's float zero points) instead of dequantised at load (the default SmolLM2 file is Q4_1).
        calibration_file: text whose activations calibrate AWQ / GPTQ / SmoothQuant and the fp8 weights of fp8 /
            w8a8_fp8: a .txt file, a .jsonl file (a "text" field per line) or a directory of them (None: the
            mixed prose and code shipped in model/calibration/); int8, int4_rtn and w8a8_fp8_rtn need none.
        stream_layout: int8 / fp8 / int4_* only (STREAM_LAYOUT_METHODS): also store each quantised weight in the
            Hopper streaming kernel's [N, K] layout (pallas_kernels/stream_matmul_mgpu.py), which decode then runs
            on (int4 weights a checkpoint kept quantised, GGUF Q4_0 / Q4_1, too). On the H200 at Llama-3-8B shape
            it took int8 from 215 to 265 tok/s at batch 1 and 3,971 to 9,436 at batch 64 (BENCHMARKS.md), at the
            cost of a second copy of the quantised weights (less room for KV pages). Off by default.
    """

    method: str | None = None
    calibration_file: str | None = None
    stream_layout: bool = False

    def __post_init__(self):
        if self.method is not None:
            _check_choice("quantization", self.method, QUANTIZATION_CHOICES)
        if self.calibration_file is not None:
            _check(
                isinstance(self.calibration_file, str) and self.calibration_file,
                "calibration_file",
                self.calibration_file,
                "a path to a text file",
            )
            _check(self.method in CALIBRATED_QUANTIZATIONS, "calibration_file", self.calibration_file,
                   f"given with a calibrated quantization ({', '.join(CALIBRATED_QUANTIZATIONS)}), "
                   f"not {self.method!r}")  # fmt: skip
        if self.stream_layout:
            _check(self.method in STREAM_LAYOUT_METHODS, "quantized_stream_layout", self.stream_layout,
                   f"given with quantization {', '.join(STREAM_LAYOUT_METHODS)}, not {self.method!r}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How the engine runs on the device.

    Attributes:
        attention_backend: None (the fastest on the device) or one of ATTENTION_BACKENDS.
        warmup: compile every step bucket at start-up; None: on accelerators only (minutes on a CPU).
        compilation_cache_dir: persistent XLA compilation cache ('~' expanded when enabled); '' disables it.
    """

    attention_backend: str | None = None
    warmup: bool | None = None
    compilation_cache_dir: str = DEFAULT_COMPILATION_CACHE_DIR

    def __post_init__(self):
        if self.attention_backend is not None:
            _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check(self.warmup in (None, True, False), "warmup", self.warmup, "True, False or None")
        _check(
            isinstance(self.compilation_cache_dir, str),
            "compilation_cache_dir",
            self.compilation_cache_dir,
            "a path ('' disables it)",
        )


# Flat option name -> (section, field). The single list of the names LLM(...), from_kwargs and the flags accept.
FLAT_OPTIONS: dict[str, tuple[str, str]] = {
    "model": ("model", "model"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_kv_blocks"),
    "kv_cache_memory_fraction": ("cache", "kv_cache_memory_fraction"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "enable_prefix_caching": ("scheduler", "enable_prefix_caching"),
    "policy": ("scheduler", "policy"),
    "decode_steps": ("scheduler", "decode_steps"),
    "async_scheduling": ("scheduler", "async_scheduling"),
    "max_prefill_tokens_while_decoding": ("scheduler", "max_prefill_tokens_while_decoding"),
    "prefill_share_while_waiting": ("scheduler", "prefill_share_while_waiting"),
    "data_parallel_size": ("parallel", "dp"),
    "tensor_parallel_size": ("parallel", "tp"),
    "pipeline_parallel_size": ("parallel", "pp"),
    "expert_parallel_size": ("parallel", "ep"),
    "pipeline_microbatches": ("parallel", "microbatches"),
    "speculative_method": ("speculative", "method"),
    "num_speculative_tokens": ("speculative", "num_speculative_tokens"),
    "speculative_model": ("speculative", "speculative_model"),
    "speculative_batch_threshold": ("speculative", "speculative_batch_threshold"),
    "speculative_draft_layers": ("speculative", "speculative_draft_layers"),
    "speculative_device_loop": ("speculative", "device_loop"),
    "quantization": ("quantization", "method"),
    "calibration_file": ("quantization", "calibration_file"),
    "quantized_stream_layout": ("quantization", "stream_layout"),
    "attention_backend": ("runtime", "attention_backend"),
    "warmup": ("runtime", "warmup"),
    "compilation_cache_dir": ("runtime", "compilation_cache_dir"),
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from. Build it with `from_kwargs` (flat names) or from the sections.

    Flat names read through: `config.max_num_seqs` is `config.scheduler.max_num_seqs`; `model` and
    `quantization` name sections (their flat values are `config.model.model` and `config.quantization.method`).
    """

    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    quantization: QuantizationConfig = dataclasses.field(default_factory=QuantizationConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if not isinstance(section, f.default_factory):
                raise ValueError(f"EngineConfig.{f.name} must be a {f.default_factory.__name__}, got {section!r}")
        # data / tensor / expert / pipeline parallel: built; the model-dependent checks (heads, experts, layers,
        # device count) run when the engine builds its meshes (sharding/config.py check_parallel).
        if self.pipeline_microbatches and self.pipeline_parallel_size == 1:
            raise ValueError("pipeline_microbatches needs pipeline_parallel_size > 1")
        if self.pipeline_parallel_size > 1 and self.speculative.method == "self":  # it lends the target's layer KV
            raise ValueError("pipeline_parallel_size > 1 and speculative_method='self' do not combine yet")
        if self.quantization.stream_layout and self.parallel.tp * self.parallel.pp * self.parallel.ep > 1:
            raise ValueError("quantized_stream_layout has no sharding rules yet: use it with one device per replica")
        length, blocks, bs = self.model.max_model_len, self.cache.num_kv_blocks, self.cache.block_size
        if length is not None and blocks is not None and (blocks - 1) * bs < length:
            raise ValueError(
                f"num_kv_blocks={blocks} (block 0 is the null page) holds {(blocks - 1) * bs} tokens of "
                f"block_size={bs}: too few for one sequence of max_model_len={length}"
            )

    @classmethod
    def from_kwargs(cls, **flat: Any) -> EngineConfig:
        """Builds the tree from flat option names (those of FLAT_OPTIONS); raises ValueError for unknown ones."""
        unknown = [k for k in flat if k not in FLAT_OPTIONS]
        if unknown:
            name = unknown[0]
            close = difflib.get_close_matches(name, FLAT_OPTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known options: {', '.join(FLAT_OPTIONS)}"
            raise ValueError(f"unknown engine option {name!r}{hint}")
        sections: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            section, field = FLAT_OPTIONS[name]
            if section == "parallel":  # ParallelConfig names its fields dp/tp/pp/ep; name the option here
                _check_int(name, value, 0 if name == "pipeline_microbatches" else 1)
            sections.setdefault(section, {})[field] = value
        types = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        return cls(**{name: types[name](**fields) for name, fields in sections.items()})

    def to_kwargs(self) -> dict[str, Any]:
        """The flat options; `EngineConfig.from_kwargs(**c.to_kwargs()) == c`."""
        return {name: getattr(getattr(self, s), f) for name, (s, f) in FLAT_OPTIONS.items()}

    def usable_kv_blocks(self, max_model_len: int) -> int:
        """The default KV pool where free memory is not measured per device (a CPU host), capped there by
        kv_cache_memory_fraction of the memory available (serving/engine/runner.py size_kv_pool): room for one
        sequence of max_model_len tokens and a block for each other running sequence, plus the null page.

        Not max_num_seqs x max_model_len: for SmolLM2 (16 x 8,192 tokens of float32 KV) that is 6 GB a host
        would zero and hold for a 135M model. Sequences that outgrow this pool together are preempted and
        recomputed (the scheduler); num_kv_blocks sets a larger pool."""
        return -(-max_model_len // self.cache.block_size) + (self.scheduler.max_num_seqs or CPU_MAX_NUM_SEQS)

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with some flat options changed, validated again."""
        return EngineConfig.from_kwargs(**(self.to_kwargs() | flat))

    def __getattr__(self, name: str) -> Any:
        if name in FLAT_OPTIONS:  # only reached for names that are not sections
            section, field = FLAT_OPTIONS[name]
            return getattr(getattr(self, section), field)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """HTTP settings of the server binary (the engine's are an EngineConfig).

    Attributes:
        host, port: where to listen.
        api_key: when set, /v1 requests need `Authorization: Bearer <api_key>`.
        served_model_name: the name clients pass as `model`; None: the model's display name.
        max_queue: most requests waiting for a slot; beyond it 503 + Retry-After.
        drain_timeout_s: on SIGTERM, how long in-flight requests may take to finish; then they end with an
            OpenAI error saying the server is shutting down.
        log_level: uvicorn and server log level.
        max_body_bytes: largest request body accepted (413 beyond; a full-context token-id list is ~100 KB).
        header_timeout_s: a connection must send a complete request head this soon after connecting.
        body_timeout_s: longest wait for the next piece of a request body (408 beyond).
        keep_alive_s: an idle keep-alive connection is closed after this long.
        enable_docs: serve /docs, /redoc and /openapi.json.
        protect_metrics: /metrics needs the API key too (when one is set).
        body_deadline_s: longest time for a whole request body (408 beyond); None: 4 x body_timeout_s.
        stall_timeout_s: /health answers 503 once the engine loop has had work and made no progress this long.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queue: int = 256
    drain_timeout_s: float = 300.0
    log_level: str = "info"
    max_body_bytes: int = 16 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    enable_docs: bool = False
    protect_metrics: bool = False
    body_deadline_s: float | None = None
    stall_timeout_s: float = 60.0

    def __post_init__(self):
        _check(_is_int(self.port) and 0 <= self.port <= 65535, "port", self.port, "in [0, 65535]")
        _check_int("max_queue", self.max_queue, 0)
        _check(self.drain_timeout_s >= 0, "drain_timeout_s", self.drain_timeout_s, ">= 0")
        _check_choice("log_level", self.log_level, ("debug", "info", "warning", "error"))
        _check_int("max_body_bytes", self.max_body_bytes, 1)
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "stall_timeout_s"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        if self.body_deadline_s is not None:
            _check(self.body_deadline_s > 0, "body_deadline_s", self.body_deadline_s, "> 0")
