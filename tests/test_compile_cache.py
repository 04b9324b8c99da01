"""The persistent compile cache on a CPU host: a restarted process loads what the first one compiled (JAX's
persistent cache, serving/engine/llm.py enable_compilation_cache) and generates the same tokens; processes sharing
the directory at the same time (a server and `make run`, runs of different shapes) and entries cut short (a read
during a write, a process killed while writing) never load a bad executable; the runner's own executable cache
stays off there (serving/engine/executable_cache.py caches_compiled_code says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.executable_cache import caches_compiled_code
from serving.engine.llm import LLM

hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 2  # other values: other step shapes in the same directory
llm = LLM.from_model(random_model(ModelConfig.tiny(), jnp.float32, seed=1), None, attention_backend="xla",
                     max_num_seqs=seqs, max_num_batched_tokens=32, block_size=8, num_kv_blocks=32, max_model_len=64,
                     compilation_cache_dir=sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # tiny steps compile in under the default 1 s
ids = [o.token_ids for o in llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4]], max_tokens=6)]
print(json.dumps(dict(ids=ids, hits=len(hits), executable_cache=caches_compiled_code(),
                      compiles=llm.engine.runner.num_compiles)))
"""


def _start(cache_dir, seqs: int = 2) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="true")
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(cache_dir), str(seqs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]) | {"stderr": err}


def _run(cache_dir, seqs: int = 2) -> dict:
    return _result(_start(cache_dir, seqs))


def test_a_restarted_process_loads_the_compiled_steps(tmp_path):
    cold = _run(tmp_path)
    assert cold["hits"] == 0 and not cold["executable_cache"] and cold["compiles"] > 0
    assert any(name.startswith("jit_step") for name in os.listdir(tmp_path))  # the runner's steps were stored
    warm = _run(tmp_path)
    assert warm["hits"] >= cold["compiles"], (cold, warm)  # every step (and more) read back, none compiled
    assert warm["ids"] == cold["ids"]


def test_an_executable_read_from_jax_cache_is_not_stored_again_on_cpu(tmp_path):
    """Serialized again, such an executable would not run when read back on XLA:CPU ("Function ... not found")."""
    import jax
    import jax.numpy as jnp

    from serving.engine.executable_cache import ExecutableCache
    from sharding.config import ParallelConfig
    from sharding.mesh import make_mesh

    mesh = make_mesh(ParallelConfig(), devices=jax.devices()[:1])
    cache, args = ExecutableCache(str(tmp_path)), (jax.ShapeDtypeStruct((4,), jnp.float32),)
    exe = jax.jit(lambda x: x + 1).lower(*args).compile()
    assert cache.load(("a",), args, mesh, None) is None
    jax.monitoring.record_event("/jax/compilation_cache/cache_hits")  # as JAX records a persistent-cache hit
    cache.store(("a",), args, mesh, exe)
    assert list(tmp_path.iterdir()) == []
    assert cache.load(("b",), args, mesh, None) is None  # a fresh compile is stored
    cache.store(("b",), args, mesh, exe)
    assert len(list(tmp_path.iterdir())) == 1


def test_processes_sharing_the_directory_at_once_load_no_bad_entry(tmp_path):
    """Two processes of different step shapes (and shapes in common: the sampler's, the small jits') compile into
    one directory at the same time, then every entry is cut to half its length, as a reader sees a file that a
    writer has not finished (JAX writes entries in place) or a writer killed part-way leaves it: a process then
    reads the damaged entries, rejects them (their zlib stream is incomplete) and compiles instead, and generates
    the tokens it generated the first time."""
    first = [_result(p) for p in [_start(tmp_path, 2), _start(tmp_path, 4)]]
    assert all(r["compiles"] > 0 for r in first)
    entries = [f for f in tmp_path.iterdir() if f.name.endswith("-cache")]
    assert len(entries) > max(r["compiles"] for r in first)  # both processes' steps, the small jits too
    for f in entries:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    again = _run(tmp_path, 4)
    assert again["ids"] == first[1]["ids"]
    assert "Error reading persistent compilation cache entry" in again["stderr"]
