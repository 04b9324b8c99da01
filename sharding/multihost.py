"""One engine over the devices of several processes: process 0 schedules, the others replay its runner calls.

    process 0:  LLMEngine (scheduler, sampling, detokenising)  --- engine.runner = LeaderRunner(runner) --->
                each forward / decode_loop / copy_blocks call is broadcast (pickled host inputs), then run
    process i:  the same LLMEngine built the same way, then follow(engine.runner): receive a call, run it

Every compiled step spans the global mesh (sharding/mesh.py over jax.devices() of all processes), so every
process must launch the same computations in the same order; the broadcast gives the followers exactly the
leader's host inputs. What the leader's host code reads comes back replicated first: a forward's logits are
gathered to every device inside one more global computation (both sides run it) and returned to the engine as a
host array; a decode loop's tokens and logprobs are replicated the same way before the engine fetches them. A
chained decode loop names the loop it follows by its sequence number, which both sides keep.

On CPU, cross-process collectives need gloo (`initialize` sets it). Tested with 2 processes x 4 CPU devices on
loopback (tests/test_parallel_multihost.py).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from sharding.mesh import initialize_distributed

_STOP = "stop"


def initialize(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """jax.distributed.initialize from the flags (a no-op for one process); CPU collectives through gloo."""
    if (num_processes or 1) > 1 and jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    return initialize_distributed(coordinator_address, num_processes, process_id)


def broadcast_object(obj: Any = None) -> Any:
    """Process 0's `obj` on every process (pickled; two small collectives: the length, then the bytes)."""
    leader = jax.process_index() == 0
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if leader else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(payload.size if leader else 0)))
    buf = payload if leader else np.zeros(n, np.uint8)
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes())


def _replicated(mesh, *arrays):
    """The arrays gathered to every device of `mesh` (one global computation)."""
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.jit(lambda *a: a, out_shardings=(rep,) * len(arrays))(*arrays)


class _Replayer:
    """Runs runner calls identically on every process; LoopHandles are numbered in call order."""

    def __init__(self, runner):
        self.runner = runner
        self.loops: dict[int, Any] = {}  # sequence number -> handle (the last two)
        self.seq_of: dict[int, int] = {}  # id(handle) -> sequence number

    def run(self, method: str, args: tuple, kwargs: dict) -> Any:
        r = self.runner
        if method == "forward":
            (logits,) = _replicated(r.mesh, r.forward(*args, **kwargs))
            return np.asarray(logits.addressable_data(0))
        if method == "decode_loop":
            chain = kwargs.pop("chain", None)
            if chain is not None:
                chain = (self.loops[chain[0]], chain[1])
            handle = r.decode_loop(*args, chain=chain, **kwargs)
            tokens, logprobs = _replicated(r.mesh, handle.tokens, handle.logprobs)
            handle = dataclasses.replace(handle, tokens=tokens, logprobs=logprobs)
            seq = self.next_seq = getattr(self, "next_seq", -1) + 1
            self.loops[seq], self.seq_of[id(handle)] = handle, seq
            old = self.loops.pop(seq - 2, None)  # a chain reaches back one loop only
            if old is not None:
                self.seq_of.pop(id(old), None)
            return handle
        if method == "copy_blocks":
            return r.copy_blocks(*args, **kwargs)
        raise ValueError(f"multihost: runner.{method} cannot be replayed")


class LeaderRunner:
    """Process 0's stand-in for the engine's ModelRunner: broadcasts each call, then runs it like the followers.
    Every other attribute reads through to the runner."""

    def __init__(self, runner):
        self._replayer = _Replayer(runner)
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def _call(self, method: str, *args, **kwargs):
        wire = dict(kwargs)
        if wire.get("chain") is not None:
            wire["chain"] = (self._replayer.seq_of[id(wire["chain"][0])], wire["chain"][1])
            kwargs["chain"] = wire["chain"]
        broadcast_object((method, args, wire))
        return self._replayer.run(method, args, kwargs)

    def forward(self, rows):
        return self._call("forward", rows)

    def decode_loop(self, *args, **kwargs):
        return self._call("decode_loop", *args, **kwargs)

    def copy_blocks(self, pairs):
        return self._call("copy_blocks", pairs)

    def stop_followers(self) -> None:
        broadcast_object((_STOP, (), {}))


def follow(runner) -> int:
    """A follower process's loop: replays process 0's runner calls until it stops them; returns how many ran."""
    replayer, n = _Replayer(runner), 0
    while True:
        method, args, kwargs = broadcast_object()
        if method == _STOP:
            return n
        replayer.run(method, args, kwargs)
        n += 1


def leader_is_me() -> bool:
    return jax.process_index() == 0


def lead_or_follow(engine) -> bool:
    """What a binary does with its engine in a multi-process job, once every process has built it the same way.

    Process 0 (or a single process): its runner becomes a LeaderRunner (a no-op alone) and True comes back: go on
    and generate or serve, then `stop_followers(engine)`. Any other process: replays process 0's runner calls
    until they stop, then returns False: exit.
    """
    if jax.process_count() == 1:
        return True
    if not hasattr(engine, "runner"):  # a DataParallelEngine: its replicas' runners are not replayed yet
        raise ValueError(
            f"data_parallel_size={engine.config.data_parallel_size} with num_processes={jax.process_count()} is not "
            "supported yet (one multi-host engine, or replicas within one process)"
        )
    if leader_is_me():
        engine.runner = LeaderRunner(engine.runner)
        return True
    follow(engine.runner)
    return False


def stop_followers(engine) -> None:
    """Ends the followers' replay loops (process 0 of a multi-process job; a no-op otherwise)."""
    if isinstance(engine.runner, LeaderRunner):
        engine.runner.stop_followers()


__all__ = [
    "LeaderRunner",
    "broadcast_object",
    "follow",
    "initialize",
    "lead_or_follow",
    "leader_is_me",
    "stop_followers",
]
