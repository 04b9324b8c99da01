"""The engine's absl flags, defined once for every binary (serving/server.py, serving/generate.py,
benchmarks/bench.py): one flag per EngineConfig option, named as the option, defaulting to the config's default.

    flags  --engine_config_from_flags()-->  EngineConfig.from_kwargs(...)  (validates; ValueError names the flag)

Flags carry no bounds of their own: EngineConfig validates every value, once. Importing this module defines the
flags, so a binary imports it before absl parses argv; it also makes the binary's --help list them and exit 0.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from serving.cli import install_help_flag
from serving.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    FLAT_OPTIONS,
    KV_CACHE_DTYPES,
    POLICIES,
    QUANTIZATION_CHOICES,
    SPECULATIVE_METHODS,
    EngineConfig,
)

FLAGS = flags.FLAGS
_D = EngineConfig()

# Model
flags.DEFINE_string(
    "model", _D.model.model, "GGUF file, HF safetensors dir or Orbax dir (default: SmolLM2-135M-Instruct)"
)
flags.DEFINE_enum("dtype", _D.dtype, list(DTYPES), "weights and compute dtype")
flags.DEFINE_integer("max_model_len", _D.max_model_len, "context limit, prompt + output (default: the model's)")
# KV cache
flags.DEFINE_integer("block_size", _D.block_size, "tokens per KV block (a power of two)")
flags.DEFINE_integer("num_kv_blocks", _D.num_kv_blocks, "KV blocks in the pool (default: sized from free memory)")
flags.DEFINE_float(
    "kv_cache_memory_fraction", _D.kv_cache_memory_fraction, "share of free device memory for the KV cache, in (0, 1]"
)
flags.DEFINE_enum("kv_cache_dtype", _D.kv_cache_dtype, list(KV_CACHE_DTYPES), "KV cache dtype (auto: the model's)")
# Scheduler
flags.DEFINE_integer("max_num_seqs", _D.max_num_seqs, "most sequences decoded together")
flags.DEFINE_integer("max_num_batched_tokens", _D.max_num_batched_tokens, "token budget of one engine step")
flags.DEFINE_bool("enable_prefix_caching", _D.enable_prefix_caching, "share KV of common prompt prefixes")
flags.DEFINE_enum("policy", _D.policy, list(POLICIES), "admission order: arrival (fcfs) or request priority")
flags.DEFINE_integer(
    "decode_steps",
    _D.decode_steps,
    "decode steps per on-device loop when no request needs the host (default: 1 on a CPU host, 8 on an accelerator)",
)
flags.DEFINE_bool(
    "async_scheduling", _D.async_scheduling, "launch the next decode loop before the host applies the current one"
)
flags.DEFINE_integer(
    "max_prefill_tokens_while_decoding",
    _D.max_prefill_tokens_while_decoding,
    "prompt tokens one step carries while sequences decode (0: the whole budget); bounds inter-token latency",
)
flags.DEFINE_float(
    "prefill_share_while_waiting",
    _D.prefill_share_while_waiting,
    "share of a step's token budget one running prompt may take while requests wait to start (1.0: all of it)",
)
# Parallelism
flags.DEFINE_integer("data_parallel_size", _D.parallel.dp, "data-parallel engine replicas")
flags.DEFINE_integer("tensor_parallel_size", _D.parallel.tp, "devices each layer is split across")
flags.DEFINE_integer("pipeline_parallel_size", _D.parallel.pp, "pipeline stages")
flags.DEFINE_integer(
    "pipeline_microbatches", _D.parallel.microbatches, "microbatches per pipelined step (0: one per stage)"
)
flags.DEFINE_integer("expert_parallel_size", _D.parallel.ep, "devices the MoE experts are split across")
# Multi-host: one engine over the devices of several processes (sharding/multihost.py); process 0 leads
flags.DEFINE_string("coordinator_address", None, "host:port of process 0, where jax.distributed joins the processes")
flags.DEFINE_integer("num_processes", 1, "processes in the job (1: this process alone, no jax.distributed)")
flags.DEFINE_integer("process_id", 0, "this process's rank (0 schedules, prints and serves; the others replay)")
# Speculative decoding and quantisation
flags.DEFINE_enum("speculative_method", _D.speculative.method, list(SPECULATIVE_METHODS), "speculative decoding")
flags.DEFINE_integer("num_speculative_tokens", _D.num_speculative_tokens, "tokens proposed per speculative step")
flags.DEFINE_string(
    "speculative_model", _D.speculative_model, "draft model (method draft) or heads checkpoint dir (method medusa)"
)
flags.DEFINE_integer(
    "speculative_batch_threshold",
    _D.speculative_batch_threshold,
    "speculate only below this many running sequences (0: at any batch size)",
)
flags.DEFINE_integer(
    "speculative_draft_layers", _D.speculative_draft_layers, "target layers the self-speculative draft runs (0: half)"
)
flags.DEFINE_bool(
    "speculative_device_loop",
    _D.speculative.device_loop,
    "speculation (every method) inside the on-device decode loop",
)
flags.DEFINE_enum(
    "quantization",
    _D.quantization.method,
    list(QUANTIZATION_CHOICES),
    "weight quantisation, done at load ('gguf': keep the file's codes)",
)
flags.DEFINE_string(
    "calibration_file", _D.quantization.calibration_file, "calibration text for awq / gptq / w8a8 (default: built in)"
)
flags.DEFINE_boolean(
    "quantized_stream_layout",
    _D.quantization.stream_layout,
    "int4_*: also keep the weights in the Hopper streaming kernel's layout (2x weights); int8 / fp8 are stored in it on one Hopper GPU",
)
# Runtime
flags.DEFINE_enum(
    "attention_backend",
    _D.attention_backend,
    list(ATTENTION_BACKENDS),
    "attention kernel backend (default: the fastest on the device)",
)
flags.DEFINE_bool(
    "warmup", _D.warmup, "compile every step bucket at start-up (default: on accelerators only; the server: always)"
)
flags.DEFINE_string(
    "compilation_cache_dir", _D.compilation_cache_dir, "persistent XLA compilation cache ('' disables it)"
)

ENGINE_FLAGS = tuple(FLAT_OPTIONS)

# --help lists the binary's flags and these (absl's would list the binary's alone, and exit 1)
install_help_flag((__name__,))


def engine_flag_values() -> dict:
    """The engine flags' values by option name."""
    return {name: FLAGS[name].value for name in ENGINE_FLAGS}


def engine_config_from_flags(**overrides) -> EngineConfig:
    """The EngineConfig the flags describe (with `overrides`, flat option names, on top).

    Raises:
        ValueError: a bad, contradictory or not yet supported value, naming the flag.
    """
    return EngineConfig.from_kwargs(**(engine_flag_values() | overrides))


def changed_engine_flags() -> list[str]:
    """`--name=value` for every engine flag set away from its default (to hand on to a child server)."""
    return [FLAGS[n].serialize() for n in ENGINE_FLAGS if FLAGS[n].value != FLAGS[n].default and FLAGS[n].serialize()]


MULTIHOST_FLAGS = ("coordinator_address", "num_processes", "process_id")


@dataclasses.dataclass(frozen=True)
class MultihostSettings:
    """The multi-host flags, validated (the arguments of sharding/multihost.py `initialize`)."""

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        n, rank = self.num_processes, self.process_id
        if n < 1:
            raise ValueError(f"num_processes must be >= 1, got {n}")
        if not 0 <= rank < n:
            raise ValueError(f"process_id={rank} must be in [0, num_processes={n})")
        if n > 1 and not self.coordinator_address:
            raise ValueError(f"num_processes={n} needs --coordinator_address (host:port of process 0)")


def multihost_from_flags() -> MultihostSettings:
    """Raises ValueError naming the flag for a bad rank or count, or several processes without a coordinator."""
    return MultihostSettings(**{name: FLAGS[name].value for name in MULTIHOST_FLAGS})


def initialize_multihost_from_flags() -> bool:
    """Joins the multi-process job the flags describe (jax.distributed.initialize) before anything touches a
    device; False for one process. Call it in a binary's main before building the engine.

    Raises:
        ValueError: see `multihost_from_flags`.
    """
    settings = multihost_from_flags()
    if settings.num_processes == 1:
        return False
    from sharding.multihost import initialize  # imports JAX: only a multi-process job pays for it here

    return initialize(settings.coordinator_address, settings.num_processes, settings.process_id)
