"""Data parallelism: `data_parallel_size` independent LLMEngine replicas, each on its own slice of the devices
(its own tp x ep x pp mesh), behind one engine interface for LLM.generate and the server's AsyncEngine.

    devices  [d0 .. d(n-1) | dn .. d(2n-1) | ...]    n = tp * pp * ep devices per replica, replica i the i-th slice
    add_request --> serving/core/dispatch.py: the replica with the fewest unfinished requests (ties: the lowest)
    step()      --> every replica with work steps, in its own thread (a step waits on its own device results,
                    so the replicas' devices run at once), outputs concatenated in replica order
    generate    --> LLMEngine.generate itself, over this object: it only needs add_request / step / abort /
                    pop_finished and the per-request tracks, which are the replicas' tracks chained

A request lives on one replica from dispatch to pop_finished: its KV, prefix cache and seed stay there, so each
output is what a one-replica engine gives the same request (greedy, or sampled with the same seed; a batch that
dp=1 would run together runs split here, and sampling draws per request from fold_in(key(seed), step)). Request
ids are issued here, so replicas never mint the same one. Each replica holds its own copy of the weights.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import jax

from serving.config import EngineConfig
from serving.core.dispatch import ReplicaRouter, SchedulersView
from serving.core.request import RequestOutput
from serving.engine import weights
from serving.engine.engine import LLMEngine
from sharding.config import check_parallel


class DataParallelEngine:
    """`config.data_parallel_size` LLMEngine replicas with least-loaded dispatch.

    Args:
      model: the Flax NNX decoder; replica 0 adopts it, the others get copies.
      tokenizer: shared by the replicas (read-only).
      config: the EngineConfig; each replica runs it with data_parallel_size=1 on its own devices.

    Raises:
      ValueError: the mesh does not fit the devices or the model (sharding/config.py check_parallel, naming the
        wrong degree).
    """

    def __init__(self, model, tokenizer, config: EngineConfig):
        check_parallel(config.parallel, model.cfg, jax.device_count())
        dp, per = config.data_parallel_size, config.replace(data_parallel_size=1)
        n, devices = per.parallel.num_devices, jax.devices()
        models = [model] + [weights.own_model(model) for _ in range(dp - 1)]  # copied before any is placed
        self.config, self.tokenizer = config, tokenizer
        self.replicas = [
            LLMEngine(m, tokenizer, per, devices=devices[i * n : (i + 1) * n]) for i, m in enumerate(models)
        ]
        self.scheduler = SchedulersView([r.scheduler for r in self.replicas])
        self.eos_token_ids, self.vocab_size = self.replicas[0].eos_token_ids, self.replicas[0].vocab_size
        self.max_model_len = self.replicas[0].max_model_len
        self._router = ReplicaRouter(dp)
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(dp, thread_name_prefix="dp-replica")
        self.num_steps = 0

    # The engine interface ------------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids, params, request_id=None, prompt=None, priority=0) -> str:
        """LLMEngine.add_request on the least-loaded replica; raises what it raises (the request is not kept)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        loads = [r.scheduler.num_waiting + r.scheduler.num_running for r in self.replicas]
        replica = self.replicas[self._router.assign(rid, loads)]
        try:
            return replica.add_request(prompt_token_ids, params, rid, prompt, priority)
        except Exception:
            self._router.release(rid)
            raise

    def abort(self, request_id: str) -> None:
        i = self._router.release(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work, concurrently; their outputs in replica order."""
        busy = [r for r in self.replicas if r.has_unfinished()]
        if len(busy) == 1:
            outputs = [busy[0].step()]
        else:
            outputs = list(self._pool.map(LLMEngine.step, busy))
        self.num_steps += 1
        return [out for outs in outputs for out in outs]

    def pop_finished(self, request_id: str):
        i = self._router.release(request_id)
        return None if i is None else self.replicas[i].pop_finished(request_id)

    def router_load(self):
        """MoE router statistics [layers, experts] summed over the replicas (None: a dense model)."""
        loads = [r.runner.router_load() for r in self.replicas]
        return None if loads[0] is None else sum(loads)

    def warmup(self) -> None:
        for r in self.replicas:
            r.warmup()

    # LLMEngine.generate reads requests' output state by id: the replicas', together.
    def running(self, request_id: str) -> bool:
        return any(r.running(request_id) for r in self.replicas)

    def track(self, request_id: str):
        return next((t for r in self.replicas if (t := r.track(request_id)) is not None), None)

    generate = LLMEngine.generate


def make_engine(model, tokenizer, config: EngineConfig):
    """An LLMEngine, or a DataParallelEngine when config.data_parallel_size > 1."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(model, tokenizer, config)
    return LLMEngine(model, tokenizer, config)
