"""OpenAI-compatible HTTP server (absl binary): flags -> engine options -> the FastAPI app of serving/api/app.py.

python -m serving.server                                   # the embedded SmolLM2 on 127.0.0.1:8000
python -m serving.server --model m.gguf --port 9000 --api_key secret --max_num_seqs 64
"""

from __future__ import annotations

import logging
import os
import sys

import uvicorn
from absl import app as absl_app
from absl import flags

from serving.api.app import DEFAULT_MODEL_NAME, DrainingServer, create_app

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "GGUF file, HF safetensors dir or Orbax dir (default: SmolLM2-135M-Instruct)")
flags.DEFINE_string("served_model_name", None, "name clients pass as `model` (default: the model file's name)")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=0, upper_bound=65535)
flags.DEFINE_string(
    "api_key",
    os.environ.get("PALLAS_SERVE_API_KEY"),
    "require `Authorization: Bearer <key>` on /v1 (default: $PALLAS_SERVE_API_KEY)",
)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_integer("max_model_len", None, "context limit, prompt + output (default: the model's)", lower_bound=2)
flags.DEFINE_integer("max_num_seqs", 16, "most sequences decoded together", lower_bound=1)
flags.DEFINE_integer("max_queue", 256, "most requests waiting for a slot; beyond it 503 + Retry-After", lower_bound=0)
flags.DEFINE_float(
    "kv_cache_memory_fraction", 0.85, "share of free device memory for the KV cache", lower_bound=0.01, upper_bound=1.0
)
flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget of one engine step", lower_bound=1)
flags.DEFINE_integer("block_size", 16, "tokens per KV block", lower_bound=1)
flags.DEFINE_integer("num_kv_blocks", None, "KV blocks in the pool (default: sized from memory)", lower_bound=2)
flags.DEFINE_bool("enable_prefix_caching", True, "share KV of common prompt prefixes")
flags.DEFINE_enum(
    "attention_backend",
    None,
    ["mosaic_gpu", "triton", "interpret", "xla"],
    "attention kernel backend (default: the fastest on the device)",
)
flags.DEFINE_integer("decode_steps", 8, "decode steps per on-device loop when no request needs the host", lower_bound=1)
flags.DEFINE_bool("warmup", True, "compile every step bucket before /health reports ok")
flags.DEFINE_string(
    "compilation_cache_dir",
    os.path.join(os.path.expanduser("~"), ".cache", "pallas-serve", "xla"),
    "persistent XLA compilation cache ('' disables it)",
)
flags.DEFINE_float(
    "drain_timeout_s", 300.0, "on SIGTERM, how long in-flight requests may take to finish", lower_bound=0.0
)
flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"], "uvicorn and server log level")


def engine_options_from_flags() -> dict:
    return dict(
        max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        block_size=FLAGS.block_size,
        num_kv_blocks=FLAGS.num_kv_blocks,
        enable_prefix_caching=FLAGS.enable_prefix_caching,
        kv_cache_memory_fraction=FLAGS.kv_cache_memory_fraction,
        attention_backend=FLAGS.attention_backend,
        decode_steps=FLAGS.decode_steps,
    )


def default_model_name(model: str | None) -> str:
    if model in (None, "", "default"):
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def enable_compilation_cache(directory: str) -> None:
    """Persistent XLA cache: a restarted server loads its step executables instead of recompiling them."""
    if not directory:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv) -> int:
    if len(argv) > 1:
        print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    logging.basicConfig(level=FLAGS.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    enable_compilation_cache(FLAGS.compilation_cache_dir)
    options = engine_options_from_flags()

    def load():
        from serving.engine.llm import LLM

        return LLM(FLAGS.model, dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len, **options)

    asgi = create_app(
        load,
        model_name=FLAGS.served_model_name or default_model_name(FLAGS.model),
        api_key=FLAGS.api_key or None,
        max_queue=FLAGS.max_queue,
        warmup=FLAGS.warmup,
    )
    server = DrainingServer(
        uvicorn.Config(
            asgi,
            host=FLAGS.host,
            port=FLAGS.port,
            log_level=FLAGS.log_level,
            timeout_graceful_shutdown=FLAGS.drain_timeout_s,
            lifespan="on",
        )
    )
    server.run()
    load_error = asgi.state.server.engine.load_error
    if load_error is not None:
        print(f"error: cannot load the model: {load_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def entry():
    try:
        absl_app.run(main)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()
