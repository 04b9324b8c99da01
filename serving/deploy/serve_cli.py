"""`serve run` entry of the Ray Serve application, with the server's own flags in one string:

    serve run serving.deploy.serve_cli:app_builder flags="--max_model_len 1024 --ray_replicas 2"

(ray_app.py cannot import serving/server.py, which imports it to serve `--ray_replicas N`.)
"""

from __future__ import annotations

import shlex

from absl import flags

from serving import server as server_binary
from serving.deploy import flags as deploy_flags
from serving.deploy.ray_app import build_app


def app_builder(args: dict):
    """The application for `serve run`: the flags of `python -m serving.server`, parsed by absl."""
    flags.FLAGS(["serve"] + shlex.split(args.get("flags", "")))
    engine_config, server_config = server_binary.configs_from_flags()
    deploy = deploy_flags.deploy_config_from_flags(engine_config.block_size, server_config.drain_timeout_s)
    if deploy is None:  # without --ray_replicas: one replica
        flags.FLAGS.ray_replicas = 1
        deploy = deploy_flags.deploy_config_from_flags(engine_config.block_size, server_config.drain_timeout_s)
    return build_app(engine_config, server_config, deploy)
