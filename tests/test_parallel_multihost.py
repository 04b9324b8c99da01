"""Multi-host serving on loopback: 2 processes x 4 CPU devices joined by jax.distributed, one
tp=8 engine over all 8 devices. Process 0 schedules and samples (sharding/multihost.py LeaderRunner broadcasts
its runner calls), process 1 replays them (`follow`). Greedy output, with chunked prefill, 4-step chained decode
loops and a prefix-cache hit, equals a one-device engine's on process 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys
from sharding.multihost import LeaderRunner, follow, initialize

pid, port = int(sys.argv[1]), sys.argv[2]
initialize(f"127.0.0.1:{port}", 2, pid)
import jax, jax.numpy as jnp, numpy as np
from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.transformer import random_model
from serving.config import EngineConfig
from serving.engine.engine import LLMEngine

assert jax.device_count() == 8 and jax.local_device_count() == 4
cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2)
options = dict(attention_backend="xla", max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=48,
               decode_steps=4, enable_prefix_caching=True, max_model_len=64, warmup=False, compilation_cache_dir="")
engine = LLMEngine(random_model(cfg, jnp.float32, seed=7), NullTokenizer(),
                   EngineConfig.from_kwargs(**options, tensor_parallel_size=8))
pages = engine.runner.kv_cache[0][0]
assert len(pages.sharding.device_set) == 8 and pages.sharding.shard_shape(pages.shape)[0] == 1
if pid != 0:
    print("followed", follow(engine.runner))
    sys.exit(0)
rng = np.random.default_rng(0)
a, c = rng.integers(3, 500, 21).tolist(), rng.integers(3, 500, 3).tolist()
b = a[:12] + rng.integers(3, 500, 5).tolist()
def run(e):
    first = e.generate([None] * 2, [a, c], max_tokens=9, temperature=0.0, ignore_eos=True)
    second = e.generate([None] * 2, [b, a], max_tokens=6, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in first + second]
engine.runner = LeaderRunner(engine.runner)
got = run(engine)
assert engine.scheduler.prefix_hit_tokens >= 12
engine.runner.stop_followers()
want = run(LLMEngine(random_model(cfg, jnp.float32, seed=7), NullTokenizer(), EngineConfig.from_kwargs(**options)))
assert got == want, (got, want)
print("ok", got)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_serve_one_tp8_engine():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": root}
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(i), port],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{out[-2000:]}\n{err[-4000:]}"
    assert "ok" in outs[0][0] and "followed" in outs[1][0], outs[0][0][-1000:] + outs[1][0][-1000:]
    replayed = int(outs[1][0].split("followed", 1)[1].split()[0])
    assert replayed >= 6, replayed  # prefill chunks, decode steps and loops of both batches
