"""OpenAI-compatible HTTP server (absl binary): flags -> EngineConfig + ServerConfig -> the FastAPI app of
serving/api/app.py.

python -m serving.server                                   # the embedded SmolLM2 on 127.0.0.1:8000
python -m serving.server --model m.gguf --port 9000 --api_key secret --max_num_seqs 64

The engine flags (serving/flags.py) are shared with serving/generate.py and benchmarks/bench.py; the flags
below are the server's own. `--warmup` defaults to on here: every step bucket compiles before /health says ok.
Multi-host: one process per host with --coordinator_address host:port --num_processes N --process_id i (the same
engine flags everywhere); process 0 serves HTTP, the others replay its engine steps on their devices.
"""

from __future__ import annotations

import logging
import os
import sys

import uvicorn
from absl import app as absl_app
from absl import flags

from serving import flags as engine_flags
from serving.api.app import DrainingServer, create_app
from serving.api.http import timed_h11_protocol
from serving.config import EngineConfig, ServerConfig
from serving.deploy import flags as deploy_flags  # --ray_replicas and the other Ray Serve flags

FLAGS = flags.FLAGS
_S = ServerConfig()
flags.DEFINE_string(
    "served_model_name", _S.served_model_name, "name clients pass as `model` (default: the model's file name)"
)
flags.DEFINE_string("host", _S.host, "address to listen on")
flags.DEFINE_integer("port", _S.port, "port to listen on")
flags.DEFINE_string(
    "api_key",
    os.environ.get("PALLAS_SERVE_API_KEY"),
    "require `Authorization: Bearer <key>` on /v1 (default: $PALLAS_SERVE_API_KEY)",
)
flags.DEFINE_integer("max_queue", _S.max_queue, "most requests waiting for a slot; beyond it 503 + Retry-After")
flags.DEFINE_float("drain_timeout_s", _S.drain_timeout_s, "on SIGTERM, how long in-flight requests may take to finish")
flags.DEFINE_enum("log_level", _S.log_level, ["debug", "info", "warning", "error"], "uvicorn and server log level")
flags.DEFINE_integer("max_body_bytes", _S.max_body_bytes, "largest request body accepted (413 beyond)")
flags.DEFINE_float("header_timeout_s", _S.header_timeout_s, "close connections without a request head by then")
flags.DEFINE_float("body_timeout_s", _S.body_timeout_s, "longest wait for the next piece of a body (408 beyond)")
flags.DEFINE_float("keep_alive_s", _S.keep_alive_s, "close idle keep-alive connections after this long")
flags.DEFINE_bool("enable_docs", _S.enable_docs, "serve /docs, /redoc and /openapi.json")
flags.DEFINE_bool("protect_metrics", _S.protect_metrics, "/metrics needs the API key too (when --api_key is set)")
flags.DEFINE_float(
    "body_deadline_s",
    _S.body_deadline_s,
    "longest time for a whole request body (408 beyond; default 4 x --body_timeout_s)",
)
flags.DEFINE_float(
    "stall_timeout_s",
    _S.stall_timeout_s,
    "/health answers 503 once the engine loop has had work and made no progress this long",
)

# Seconds uvicorn waits past the drain deadline, so the handlers' shutting-down errors reach the clients.
DRAIN_GRACE_S = 5.0
SERVER_FLAGS = tuple(f.name for f in _S.__dataclass_fields__.values())


def server_config_from_flags() -> ServerConfig:
    return ServerConfig(**{name: FLAGS[name].value for name in SERVER_FLAGS} | {"api_key": FLAGS.api_key or None})


def configs_from_flags() -> tuple[EngineConfig, ServerConfig]:
    """(engine, server) configs; the server warms the engine up unless --nowarmup."""
    warmup = True if FLAGS.warmup is None else FLAGS.warmup
    return engine_flags.engine_config_from_flags(warmup=warmup), server_config_from_flags()


def main(argv) -> int:
    if len(argv) > 1:
        print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    try:
        engine_config, server_config = configs_from_flags()
        deploy = deploy_flags.deploy_config_from_flags(engine_config.block_size, server_config.drain_timeout_s)
        multihost = engine_flags.initialize_multihost_from_flags()  # before anything touches a device
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if FLAGS.ray_replicas:  # engine replicas on Ray Serve behind one ingress (serving/deploy/ray_app.py)
        from serving.deploy.ray_app import serve_forever

        return serve_forever(engine_config, server_config, deploy)
    if multihost and FLAGS.process_id != 0:
        return _follow(engine_config)
    loaded = []

    def load():
        from serving.engine.llm import LLM
        from sharding import multihost as multihost_lib

        llm = LLM.from_config(engine_config)
        if multihost:  # process 0 of a multi-host job: its runner calls are broadcast from the first step on
            multihost_lib.lead_or_follow(llm.engine)
            loaded.append(llm)
        return llm

    asgi = create_app(
        load,
        model_name=server_config.served_model_name or engine_config.model.display_name,
        api_key=server_config.api_key,
        max_queue=server_config.max_queue,
        warmup=bool(engine_config.warmup),
        max_body_bytes=server_config.max_body_bytes,
        body_timeout_s=server_config.body_timeout_s,
        enable_docs=server_config.enable_docs,
        protect_metrics=server_config.protect_metrics,
        body_deadline_s=server_config.body_deadline_s,
        stall_timeout_s=server_config.stall_timeout_s,
    )
    server = DrainingServer(
        uvicorn.Config(
            asgi,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.log_level,
            http=timed_h11_protocol(server_config.header_timeout_s),
            timeout_keep_alive=server_config.keep_alive_s,
            timeout_graceful_shutdown=server_config.drain_timeout_s + DRAIN_GRACE_S,
            lifespan="on",
        ),
        drain_timeout_s=server_config.drain_timeout_s,
    )
    server.run()
    if loaded:  # the engine thread has stopped: no step races the followers' release
        from sharding import multihost as multihost_lib

        multihost_lib.stop_followers(loaded[0].engine)
    engine = asgi.state.server.engine
    if engine.load_error is not None:
        print(f"error: cannot load the model: {engine.load_error}", file=sys.stderr)
        return 1
    status = 0 if server.started else 1
    if getattr(engine, "compiling", False):  # an XLA compile cannot be interrupted: exit without waiting for it
        logging.getLogger("serving.server").warning("exiting with a background compile unfinished")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # interpreter teardown would wait for the compile thread, then crash under it
    return status


def _follow(engine_config: EngineConfig) -> int:
    """A process other than 0 of a multi-host server: builds the same engine, replays process 0's steps until it
    stops (sharding/multihost.py), serves nothing."""
    from serving.engine.llm import LLM
    from sharding import multihost as multihost_lib

    multihost_lib.lead_or_follow(LLM.from_config(engine_config).engine)
    return 0


def entry():
    try:
        absl_app.run(main)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()
