"""On-disk cache of the runner's compiled step executables, so a warm start neither traces nor compiles.

JAX's persistent compilation cache (enabled by serving/engine/llm.py on every backend) skips XLA compilation on a
restart, but every bucket is still traced and lowered first: at Llama-3-8B shape that is most of a warm start (28 lowerings of
the 32-layer model, ~33 s on the H200). This cache stores each serialized `jax.stages.Compiled` under a key that
names everything its code depends on:

    key = sha256(jax/jaxlib/flax versions, device kind + platform, mesh shape, bucket key, abstract argument tree
                 (shapes, dtypes, shardings of params / KV / inputs), the fingerprint of our traced sources)

The source fingerprint hashes every file under model/, pallas_kernels/ and sharding/ and the runner, so editing
a kernel or the model invalidates old entries. A missing, stale or unreadable entry is a miss (compile and store);
loading never raises: a failure is logged and the executable compiled instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading

import flax
import jax
from jax.experimental import serialize_executable
from jaxlib import version as _jaxlib_version

jaxlib_version = _jaxlib_version.__version__

log = logging.getLogger(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TRACED = ("model", "pallas_kernels", "sharding", os.path.join("serving", "engine", "runner.py"))


@functools.cache
def source_fingerprint() -> str:
    """sha256 over the sources whose code is traced into the step executables."""
    h = hashlib.sha256()
    for entry in _TRACED:
        path = os.path.join(_ROOT, entry)
        files = (
            [path]
            if os.path.isfile(path)
            else sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py"))
        )
        for f in files:
            h.update(os.path.relpath(f, _ROOT).encode())
            with open(f, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _describe(x) -> str:
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{spec}"


def cache_key(key: tuple, args: tuple, mesh) -> str:
    leaves, tree = jax.tree.flatten(args)
    dev = jax.devices()[0]
    parts = [
        jax.__version__,
        jaxlib_version,
        flax.__version__,
        dev.platform,
        dev.device_kind,
        str(dict(mesh.shape)),
        str([d.id for d in mesh.devices.flat]),
        repr(key),
        str(tree),
        ";".join(_describe(x) for x in leaves),
        source_fingerprint(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def caches_compiled_code() -> bool:
    """Whether the runner keeps its step executables in this cache (JAX's persistent compilation cache, keyed by
    the lowered program, serves every backend: serving/engine/llm.py enable_compilation_cache).

    Not on a CPU. There an executable that JAX's persistent cache loaded, serialized again into this cache, comes
    back without its compiled functions: the run after fails inside LLM.generate with "JaxRuntimeError: Function
    negate_power_fusion not found" (jax 0.11.2's XLA:CPU; either cache alone reads back correctly, the pair does
    not). A CPU host therefore keeps JAX's cache only, whose key, the lowered program itself, also covers every
    traced option a bucket key here does not name; tests/test_compile_cache.py restarts a process over it. Where
    this cache is used on a CPU all the same (a directory given to the runner), `store` skips an executable that
    JAX's cache loaded (a listener counts its hits per thread), so what this cache holds always reads back.
    """
    return jax.default_backend() != "cpu"


class _PersistentCacheHits(threading.local):
    """JAX persistent-cache hits in this thread since the last reset (its compiles run in the caller's thread)."""

    count = 0


_hits = _PersistentCacheHits()


def _count_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.count += 1


jax.monitoring.register_event_listener(_count_hit)


class ExecutableCache:
    """Loads or compiles+stores executables under `directory` (None: a pass-through that only compiles)."""

    def __init__(self, directory: str | None):
        self.directory = os.path.expanduser(directory) if directory else None
        self.hits = 0
        self.misses = 0

    def load(self, key: tuple, args: tuple, mesh, out_tree):
        """The stored executable for `key`, or None (no directory, no entry, or an entry that does not load).

        Args:
          key: the runner's bucket key.
          args: the abstract arguments the executable takes (their tree is the in_tree).
          mesh: the runner's mesh (part of the key).
          out_tree: the pytree structure of the outputs (serialization does not keep pytrees).
        """
        if not self.directory:
            return None
        path = self._path(key, args, mesh)
        _hits.count = 0  # what the caller compiles next, `store` receives: was it read from JAX's cache?
        if not os.path.exists(path):
            self.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                payload = f.read()
            devices = list(mesh.devices.flat)  # the mesh's devices, not every device of the process
            exe = serialize_executable.deserialize_and_load(
                payload, jax.tree.structure((args, {})), out_tree, execution_devices=devices
            )
        except Exception as e:  # noqa: BLE001 - a bad entry is a miss, never a failure
            log.warning("executable cache: cannot load %s (%s: %s); compiling", path, type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return exe

    def store(self, key: tuple, args: tuple, mesh, exe) -> None:
        """Writes `exe` for `key` (atomically); executables that cannot be serialized are skipped."""
        if not self.directory:
            return
        if _hits.count and jax.default_backend() == "cpu":  # see caches_compiled_code: it would not read back
            log.info("executable cache: not storing an executable JAX's persistent cache loaded (XLA:CPU)")
            return
        path = self._path(key, args, mesh)
        try:
            payload, _, _ = serialize_executable.serialize(exe)
        except (ValueError, NotImplementedError) as e:
            log.info("executable cache: %s cannot be serialized here (%s)", os.path.basename(path), e)
            return
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)  # a concurrent reader sees the old entry or the whole new one

    def _path(self, key: tuple, args: tuple, mesh) -> str:
        return os.path.join(self.directory, cache_key(key, args, mesh) + ".bin")
