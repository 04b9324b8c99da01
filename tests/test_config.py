"""serving/config.py, serving/flags.py and the binaries' flags: defaults, the flat-name round trip, every bad,
contradictory or not-yet-supported option refused by name, every flag of serving.server and serving.generate
reaching a config, and SamplingParams validated exactly once per request."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from serving import flags as engine_flags
from serving import generate as gen_main
from serving import server as srv_main
from serving.config import (
    DEFAULT_COMPILATION_CACHE_DIR,
    DEFAULT_MODEL_NAME,
    FLAT_OPTIONS,
    EngineConfig,
    ModelOptions,
    ServerConfig,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS

# A valid value away from the default for every engine option (the round trip and the flag walk use these).
NON_DEFAULT = dict(
    model="some/dir/m.gguf",
    dtype="bfloat16",
    max_model_len=512,
    block_size=32,
    num_kv_blocks=64,
    kv_cache_memory_fraction=0.5,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    enable_prefix_caching=False,
    policy="priority",
    decode_steps=4,
    async_scheduling=False,
    max_prefill_tokens_while_decoding=128,
    prefill_share_while_waiting=0.25,
    attention_backend="xla",
    warmup=False,
    compilation_cache_dir="/tmp/xla-cache",
)
# Options whose every non-default value is refused today ("not supported yet"), with one such value each.
REFUSED = dict(
    kv_cache_dtype="int8",
    data_parallel_size=2,
    tensor_parallel_size=2,
    pipeline_parallel_size=2,
    pipeline_microbatches=4,  # refused alone: it needs pipeline_parallel_size > 1
    expert_parallel_size=2,
    speculative_method="ngram",
    num_speculative_tokens=2,  # refused alone: it needs a method
    speculative_device_loop=False,  # refused alone: it needs a method
    speculative_model="draft.gguf",  # refused alone: it needs method "draft"
    speculative_batch_threshold=4,  # refused alone: it needs a method
    speculative_draft_layers=4,  # refused alone: it needs method "self"
    quantization="int8",
    calibration_file="calib.txt",  # refused alone: it needs a quantization
    quantized_stream_layout=True,  # refused alone: it needs quantization int8, fp8 or int4_*
)


def test_every_option_is_covered_here():
    assert set(NON_DEFAULT) | set(REFUSED) == set(FLAT_OPTIONS)


def test_defaults():
    c = EngineConfig()
    assert c == EngineConfig.from_kwargs()
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.block_size, c.decode_steps) == (None, None, 16, None)
    assert c.num_kv_blocks is None and c.kv_cache_memory_fraction == 0.85 and c.kv_cache_dtype == "auto"
    assert c.enable_prefix_caching and c.policy == "fcfs" and c.warmup is None and c.attention_backend is None
    assert c.parallel.num_devices == 1 and c.speculative.method is None and c.quantization.method is None
    assert (
        c.compilation_cache_dir == DEFAULT_COMPILATION_CACHE_DIR == os.path.join("~", ".cache", "pallas-serve", "xla")
    )
    assert c.model.display_name == DEFAULT_MODEL_NAME


def test_attention_backends_match_the_kernels():
    from pallas_kernels.backend import BACKENDS
    from serving.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS


def test_from_kwargs_round_trip_and_sections():
    c = EngineConfig.from_kwargs(**NON_DEFAULT)
    assert c.to_kwargs() == dict(EngineConfig().to_kwargs(), **NON_DEFAULT)
    assert EngineConfig.from_kwargs(**c.to_kwargs()) == c
    assert c.scheduler.max_num_seqs == c.max_num_seqs == 8 and c.cache.block_size == 32
    assert c.runtime.warmup is False and c.model.dtype == "bfloat16"
    d = c.replace(max_num_seqs=4)
    assert d.max_num_seqs == 4 and d.block_size == 32 and c.max_num_seqs == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.scheduler.max_num_seqs = 2


def test_dtype_objects_are_stored_by_name():
    import jax.numpy as jnp
    import numpy as np

    assert EngineConfig.from_kwargs(dtype=jnp.bfloat16).dtype == "bfloat16"
    assert EngineConfig.from_kwargs(dtype=np.dtype("float32")).dtype == "float32"


def test_display_name_is_the_file_name():
    assert ModelOptions("/models/Qwen2.5-0.5B-Q8_0.gguf").display_name == "Qwen2.5-0.5B-Q8_0"
    assert ModelOptions("/models/llama-hf/").display_name == "llama-hf"


def test_unknown_option_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(ValueError, match="unknown engine option 'frobnicate'"):
        EngineConfig.from_kwargs(frobnicate=1)


def test_features_once_refused_are_built():
    """kv_cache_dtype and quantization (tests/test_quant_engine.py), ngram / draft / self / medusa speculation
    (tests/test_spec_engine.py, tests/test_medusa.py), tensor / expert parallel (tests/test_parallel_engine.py),
    pipeline (tests/test_parallel_pipeline.py) and data parallel (tests/test_parallel_data.py): no option value is
    refused as "not supported yet" any more; degrees are accepted here and checked against the model and the
    devices at start-up (sharding/config.py check_parallel)."""
    from sharding.config import ParallelConfig

    degrees = dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=2)
    assert EngineConfig.from_kwargs(**degrees).parallel == ParallelConfig(dp=2, tp=2, pp=2, ep=2)


def test_config_modules_import_no_jax():
    code = "import sys, serving.config, sharding.config; assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert proc.returncode == 0


def test_parallel_config_lives_jax_free_and_is_reexported():
    from sharding import config, mesh

    assert mesh.ParallelConfig is config.ParallelConfig


# Flags ---------------------------------------------------------------------------------------------------------

BINARY_VALUES = dict(
    served_model_name="my-model",
    host="0.0.0.0",
    port=9001,
    api_key="secret",
    max_queue=7,
    drain_timeout_s=5.0,
    log_level="debug",
    max_body_bytes=1 << 20,
    header_timeout_s=3.0,
    body_timeout_s=7.0,
    keep_alive_s=2.0,
    enable_docs=True,
    protect_metrics=True,
    body_deadline_s=30.0,
    stall_timeout_s=20.0,
    prompt=["hi", "there"],
    prompts_file="p.jsonl",
    max_tokens=7,
    temperature=0.5,
    top_p=0.5,
    top_k=5,
    seed=3,
    chat=True,
    warmup_run=False,
    coordinator_address="10.0.0.1:1234",
    num_processes=2,  # refused alone: it needs a coordinator
    process_id=1,  # refused alone: one process has rank 0 only
)


def _binary_flags() -> list[str]:
    modules = (engine_flags, srv_main, gen_main)
    return sorted({f.name for m in modules for f in FLAGS.get_flags_for_module(m)})


@pytest.fixture(autouse=True, scope="module")
def parsed_flags():
    FLAGS.mark_as_parsed()


def test_every_engine_option_has_a_flag():
    assert set(FLAT_OPTIONS) <= set(_binary_flags())
    assert set(engine_flags.ENGINE_FLAGS) == set(FLAT_OPTIONS)


def _arrived(name: str, value, build) -> bool:
    """True when the config `build()` makes carries `value` under `name`, or refuses it naming the flag."""
    try:
        got = build()
    except ValueError as e:
        assert name in str(e), (name, str(e))
        return True
    fields = got.to_kwargs() if isinstance(got, EngineConfig) else dataclasses.asdict(got)
    return name in fields and fields[name] == (tuple(value) if isinstance(value, list) else value)


@pytest.mark.parametrize("name", _binary_flags())
def test_every_flag_reaches_a_config(name):
    """A flag set away from its default arrives in the EngineConfig, ServerConfig or GenerateSettings its
    binary builds (or is refused by name): a flag without a consumer fails here."""
    value = NON_DEFAULT.get(name, REFUSED.get(name, BINARY_VALUES.get(name)))
    assert value is not None, f"--{name}: add a non-default value to this test, and a consumer to the binary"
    assert value != FLAGS[name].default, name
    with flagsaver.flagsaver(**{name: value}):
        if name in FLAT_OPTIONS:
            assert _arrived(name, value, lambda: srv_main.configs_from_flags()[0]), f"--{name} (server)"
            assert _arrived(name, value, engine_flags.engine_config_from_flags), f"--{name} (generate)"
        elif name in engine_flags.MULTIHOST_FLAGS:  # every binary: serving/generate.py, server.py, bench
            assert _arrived(name, value, engine_flags.multihost_from_flags), f"--{name}"
        elif name in {f.name for f in dataclasses.fields(ServerConfig)}:
            assert _arrived(name, value, lambda: srv_main.configs_from_flags()[1]), f"--{name}"
        else:
            assert _arrived(name, value, gen_main.settings_from_flags), f"--{name}: no consumer"


def test_server_warms_up_by_default_and_obeys_nowarmup():
    assert FLAGS.warmup is None
    assert srv_main.configs_from_flags()[0].warmup is True
    with flagsaver.flagsaver(warmup=False):
        assert srv_main.configs_from_flags()[0].warmup is False
    assert engine_flags.engine_config_from_flags().warmup is None  # generate: the engine's default


def test_changed_engine_flags_are_handed_on():
    with flagsaver.flagsaver(block_size=32, enable_prefix_caching=False, attention_backend="xla"):
        assert engine_flags.changed_engine_flags() == [
            "--block_size=32",
            "--noenable_prefix_caching",
            "--attention_backend=xla",
        ]


# The engine: warm-up and validate-once ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm():
    from checkpoints.tokenizer import NullTokenizer
    from model.config import ModelConfig
    from model.transformer import random_model
    from serving.engine.llm import LLM

    config = EngineConfig.from_kwargs(
        max_num_seqs=2,
        max_num_batched_tokens=16,
        num_kv_blocks=16,
        max_model_len=64,
        attention_backend="xla",
        decode_steps=1,
        warmup=False,
        compilation_cache_dir="",
    )
    return LLM.from_model(random_model(ModelConfig.tiny()), NullTokenizer(), config)


@pytest.mark.parametrize("backend, steps", [("cpu", 1), ("gpu", 8)])
def test_decode_steps_default_streams_every_token_on_a_cpu(tiny_llm, monkeypatch, backend, steps):
    """Unset, decode_steps is 1 on a CPU host (every token streamed when its step ends) and 8 on an accelerator
    (multi-step loops still win there); a value the user sets is kept."""
    import jax

    from serving.engine.engine import LLMEngine

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    unset = tiny_llm.engine_config.replace(decode_steps=None)
    assert LLMEngine(tiny_llm.model, tiny_llm.tokenizer, unset).config.decode_steps == steps
    assert LLMEngine(tiny_llm.model, tiny_llm.tokenizer, unset.replace(decode_steps=4)).config.decode_steps == 4


@pytest.mark.parametrize("warmup", [True, False])
def test_warmup_option_reaches_the_engine(tiny_llm, monkeypatch, warmup):
    from serving.engine.engine import LLMEngine

    calls = []
    monkeypatch.setattr(LLMEngine, "warmup", lambda self: calls.append(self))
    LLMEngine(tiny_llm.model, tiny_llm.tokenizer, tiny_llm.engine_config.replace(warmup=warmup))
    assert len(calls) == (1 if warmup else 0)


def _count_validate(monkeypatch) -> list:
    from serving.core.request import SamplingParams

    calls = []
    original = SamplingParams.validate

    def counting(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(SamplingParams, "validate", counting)
    return calls


def test_sampling_params_validated_once_by_llm_generate(tiny_llm, monkeypatch):
    calls = _count_validate(monkeypatch)
    outs = tiny_llm.generate([[5, 6, 7], [8, 9]], max_tokens=3, temperature=0.0, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert len(calls) == 1  # the batch's options, at LLM.generate; not again per prompt, in the engine or scheduler
    with pytest.raises(ValueError, match="top_p"):
        tiny_llm.generate([[5, 6]], top_p=0.0)
    with pytest.raises(ValueError, match="unknown sampling option 'use_reference'"):
        tiny_llm.generate([[5, 6]], use_reference=True)


def test_sampling_params_validated_once_by_the_server_conversion(tiny_llm, monkeypatch):
    from serving.api.protocol import CompletionRequest

    calls = _count_validate(monkeypatch)
    body = CompletionRequest(model="m", prompt=[5, 6, 7], max_tokens=3, temperature=0.0)
    params = body.sampling_params(3, None, tiny_llm.config.vocab_size)
    engine = tiny_llm.engine
    rid = engine.add_request([5, 6, 7], params)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_finished(rid) is not None
    assert len(calls) == 1


def test_llm_construction_enables_the_compilation_cache(tiny_llm, monkeypatch, tmp_path):
    import jax

    from serving.engine import llm as llm_module

    calls = {}
    monkeypatch.setattr(jax.config, "update", lambda key, value: calls.__setitem__(key, value))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")

    def no_checkpoint(model, **kwargs):
        raise FileNotFoundError("not loaded in this test")

    monkeypatch.setattr(llm_module, "load_checkpoint", no_checkpoint)
    with pytest.raises(FileNotFoundError):
        llm_module.LLM()  # the default: ~/.cache/pallas-serve/xla, before anything is loaded or compiled
    assert calls["jax_compilation_cache_dir"] == os.path.expanduser(DEFAULT_COMPILATION_CACHE_DIR)
    calls.clear()
    config = tiny_llm.engine_config
    llm_module.LLM.from_model(tiny_llm.model, tiny_llm.tokenizer, config.replace(compilation_cache_dir=str(tmp_path)))
    assert calls["jax_compilation_cache_dir"] == str(tmp_path)
    calls.clear()
    llm_module.LLM.from_model(tiny_llm.model, tiny_llm.tokenizer, config.replace(compilation_cache_dir=""))
    assert calls == {}


def test_cpu_hosts_keep_compiled_code_in_jax_cache_only(monkeypatch):
    import jax

    from serving.engine import executable_cache
    from serving.engine import llm as llm_module

    calls = {}
    monkeypatch.setattr(jax.config, "update", lambda key, value: calls.__setitem__(key, value))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    llm_module.enable_compilation_cache("/tmp/somewhere")
    assert calls["jax_compilation_cache_dir"] == "/tmp/somewhere"
    assert not executable_cache.caches_compiled_code()  # the runner's cache: not beside JAX's on a CPU
    calls.clear()
    llm_module.enable_compilation_cache("")
    assert calls == {}


def test_auto_dtype_is_bfloat16_on_an_accelerator_and_float32_on_a_cpu(monkeypatch):
    import jax.numpy as jnp

    from serving.engine import llm

    assert EngineConfig.from_kwargs().dtype == "auto"
    for backend, want in (("cpu", jnp.float32), ("gpu", jnp.bfloat16), ("tpu", jnp.bfloat16)):
        monkeypatch.setattr(llm.jax, "default_backend", lambda b=backend: b)
        assert llm.parse_dtype("auto") == want
    assert llm.parse_dtype("float16") == jnp.float16 and llm.parse_dtype(jnp.bfloat16) == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        llm.parse_dtype("int8")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.from_kwargs(dtype="float64")


def test_kv_pool_holds_what_the_limits_can_use(tiny_llm):
    """A CPU host: one sequence of max_model_len, a block for each other sequence and the null page (free memory
    is far above it here), and the start-up line says so."""
    config = tiny_llm.engine_config.replace(num_kv_blocks=None)
    assert config.usable_kv_blocks(64) == 64 // 16 + 2
    assert config.replace(block_size=32, max_num_seqs=4).usable_kv_blocks(65) == 3 + 4
    from serving.engine.llm import LLM

    llm = LLM.from_model(tiny_llm.model, tiny_llm.tokenizer, config)
    assert llm.engine.runner.num_blocks == config.usable_kv_blocks(64)
    line = llm.kv_pool_summary()
    assert line.startswith("KV pool: 80 tokens (6 blocks of 16)") and "2 sequences x 64" in line, line
