"""The OpenAI-compatible ingress of the Ray Serve application: serving/api's app over RemoteEngine.

The ingress loads no weights and imports no JAX: it asks one engine replica for its tokenizer, model config and
limits (FrontLLM), then builds the single-host server's app (serving/api/app.py `create_app`: the same routes,
validation, error bodies and server-sent events) with RemoteEngine as its engine bridge. Around it:

  - `ReplicaHeader` adds `x-pallas-replica: <replica id>` to every response a replica served (the id comes from
    RemoteEngine through a per-request context variable);
  - `ReplicaCollector` adds per-replica series to /metrics: requests sent, prefix-cache hit and looked-up
    tokens, KV blocks used and usage, queue length and running sequences (each replica's last report).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve

from serving.api.app import create_app
from serving.api.async_engine import EngineError
from serving.api.metrics import PREFIX
from serving.config import ServerConfig
from serving.core.request import prompt_token_ids
from serving.deploy.remote_engine import CURRENT_SLOT, RemoteEngine, ReplicaBook, ReplicaSlot

HEADER = b"x-pallas-replica"


class FrontLLM:
    """The part of LLM the handlers use, over a replica's FrontInfo (no weights here); `score` asks a replica."""

    def __init__(self, handle):
        info = handle.describe.remote().result()
        self._handle = handle
        self.tokenizer, self.config, self.max_model_len = info.tokenizer, info.config, info.max_model_len
        self.engine = _PoolView(info.kv_capacity_tokens, info.block_size)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt (already rendered) or ids passed through, checked as LLM.encode_prompt
        checks them."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return prompt_token_ids(ids, self.config.vocab_size)

    def score(self, token_ids):
        """Logits of one sequence, computed by a replica (blocking: RemoteEngine.call runs it on a thread)."""
        try:
            return self._handle.score.remote(list(token_ids)).result()
        except Exception as e:  # noqa: BLE001 - the handler turns it into a 503
            raise EngineError(f"scoring on a replica failed: {type(e).__name__}: {e}") from e


class _PoolView:
    """What the app reads of a local engine: `scheduler.kv` (one request's KV room) and `structured` (none here:
    constraints compile on the replicas)."""

    structured = None

    def __init__(self, capacity_tokens: int | None, block_size: int):
        kv = None if capacity_tokens is None else SimpleNamespace(num_usable_blocks=capacity_tokens // block_size)
        if kv is not None:
            kv.block_size = block_size
        self.scheduler = SimpleNamespace(kv=kv)


class ReplicaCollector:
    """Per-replica Prometheus series from a ReplicaBook (read at scrape time)."""

    def __init__(self, book: ReplicaBook):
        self.book = book

    def collect(self):
        label = ["replica"]
        requests = CounterMetricFamily(f"{PREFIX}_replica_requests", "Requests sent to each replica.", labels=label)
        for replica, n in sorted(self.book.requests.items()):
            requests.add_metric([replica], n)
        yield requests
        series = (
            (CounterMetricFamily, "replica_prefix_hit_tokens", "Prompt tokens served from the prefix cache.", "hit"),
            (CounterMetricFamily, "replica_prefix_queried_tokens", "Prompt tokens looked up in the cache.", "query"),
            (GaugeMetricFamily, "replica_kv_usage", "Fraction of the replica's KV blocks in use.", "usage"),
            (GaugeMetricFamily, "replica_kv_blocks_used", "KV blocks in use on the replica.", "used"),
            (GaugeMetricFamily, "replica_queue_length", "Requests waiting on the replica.", "waiting"),
            (GaugeMetricFamily, "replica_running_sequences", "Sequences running on the replica.", "running"),
        )
        for kind, name, doc, key in series:
            family = kind(f"{PREFIX}_{name}", doc + " Last report of each replica.", labels=label)
            for replica, s in sorted(self.book.stats.items()):
                value = {
                    "hit": s.prefix_hit_tokens,
                    "query": s.prefix_queried_tokens,
                    "usage": s.kv_usage,
                    "used": s.kv_blocks_used,
                    "waiting": s.engine.num_waiting,
                    "running": s.engine.num_running,
                }[key]
                family.add_metric([replica], value)
            yield family


class ReplicaHeader:
    """ASGI wrapper: a fresh ReplicaSlot per HTTP request; its replica id goes out as `x-pallas-replica`."""

    def __init__(self, app):
        self.app = app
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        slot = ReplicaSlot()
        token = CURRENT_SLOT.set(slot)

        async def send_with_replica(message):
            if message["type"] == "http.response.start" and slot.replica is not None:
                message = dict(message, headers=[*message.get("headers", []), (HEADER, slot.replica.encode())])
            await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            CURRENT_SLOT.reset(token)


def build_ingress_app(handle, server: ServerConfig, model_name: str, attempts: int = 3):
    """The ASGI app of one ingress replica over the engine deployment's handle."""
    asgi = create_app(
        lambda: FrontLLM(handle),
        model_name=model_name,
        api_key=server.api_key,
        max_queue=server.max_queue,
        warmup=False,  # the replicas warm their own engines up
        max_body_bytes=server.max_body_bytes,
        body_timeout_s=server.body_timeout_s,
        body_deadline_s=server.body_deadline_s,
        enable_docs=server.enable_docs,
        protect_metrics=server.protect_metrics,
        engine_class=functools.partial(RemoteEngine, handle=handle, attempts=attempts),
    )
    asgi.metrics.registry.register(ReplicaCollector(asgi.state.server.engine.book))
    return ReplicaHeader(asgi)


@serve.ingress()
class Ingress:
    """Ray Serve deployment class of the ingress (ray_app.py applies `serve.deployment`)."""

    async def __init__(self, engine, server: ServerConfig, model_name: str, attempts: int = 3):
        await engine.describe.remote()  # Ray marks the ingress running once an engine replica answers
        self._args = (engine, server, model_name, attempts)

    def __serve_build_asgi_app__(self):
        return build_ingress_app(*self._args)
