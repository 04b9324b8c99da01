"""The OpenAI-compatible HTTP app: FastAPI + uvicorn over the continuous-batching engine (binary: serving/server.py).

Endpoints: POST /v1/completions, POST /v1/chat/completions (server-sent events with `stream`), GET /v1/models,
GET /health (200 once the model is loaded and compiled; 503 before, while draining, and while the engine loop
is stalled: it has work and has completed no step for `stall_timeout_s`), GET /metrics
(Prometheus text; behind the API key with `protect_metrics`), and vLLM's POST /tokenize, POST /detokenize,
GET /tokenizer_info (lm-eval's remote tokenizer uses them). /docs, /redoc and /openapi.json exist only with
`enable_docs`.

A /v1 request is checked in this order: the API key (before a byte of the body is read), the framing and
Content-Type (400 for Content-Length with Transfer-Encoding, 415 for a body that is not JSON), the body size
(Content-Length, then the running total), read timeout and overall body deadline, UTF-8 and JSON
(serving/api/http.py), the pydantic model, then the handler; large bodies are parsed on a worker thread and
followed by a heap trim.

This module builds the app (routes, auth, error bodies, the OpenAPI description) and the draining uvicorn server;
the /v1 handlers are in serving/api/handlers.py, the engine thread in serving/api/async_engine.py. SIGTERM stops
accepting connections, lets in-flight requests finish (up to --drain_timeout_s; past it, streams end with an
OpenAI error event and `[DONE]`, other requests with a 503 error body, both saying the server is shutting down),
then stops the engine thread and exits 0. /health polls are kept out of the access log (below debug level).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import handlers, http
from serving.api.async_engine import AsyncEngine
from serving.api.handlers import ServerState
from serving.api.metrics import CONTENT_TYPE, ServerMetrics
from serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    check_text,
    describe_validation_error,
    error_body,
)
from serving.config import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME  # re-exported for clients of the app

log = logging.getLogger("serving.server")

_ERRORS = {
    400: {"description": "invalid request"},
    401: {"description": "missing or wrong API key"},
    404: {"description": "unknown model"},
    408: {"description": "the body did not arrive in time"},
    413: {"description": "body larger than max_body_bytes"},
    415: {"description": "the body is not application/json"},
    503: {"description": "loading, draining or queue full"},
}


class _DropHealthChecks(logging.Filter):
    """Drops uvicorn access-log lines of GET /health (load balancers poll it every few seconds) unless the
    access log is at debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        is_health = len(args) > 2 and str(args[2]).split("?", 1)[0] == "/health"
        return not is_health or logging.getLogger("uvicorn.access").isEnabledFor(logging.DEBUG)


def quiet_health_checks() -> None:
    """Installs the /health filter on uvicorn's access logger (idempotent)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _DropHealthChecks) for f in access.filters):
        access.addFilter(_DropHealthChecks())


# Application ---------------------------------------------------------------------------------------------------


def create_app(
    llm_factory: Callable[[], Any],
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    api_key: str | None = None,
    max_queue: int = 256,
    warmup: bool = True,
    max_body_bytes: int = 16 << 20,
    body_timeout_s: float = 60.0,
    enable_docs: bool = False,
    protect_metrics: bool = False,
    engine_class: Callable[..., Any] = AsyncEngine,
    body_deadline_s: float | None = None,
    stall_timeout_s: float = 60.0,
) -> ServerApp:
    """Builds the ASGI app; the engine thread starts (and loads the model) with the app's lifespan.

    Args:
      llm_factory: returns a serving.engine.llm.LLM (called on the engine thread, so loading does not block /health).
      model_name: the name clients must pass as `model`.
      api_key: when set, /v1 requests need `Authorization: Bearer <api_key>`.
      max_queue: most requests waiting for a slot before new ones get 503.
      warmup: run one short request before reporting healthy (bucket compilation is the engine config's
        `warmup`, done when llm_factory builds the engine).
      max_body_bytes: largest request body accepted (413 beyond).
      body_timeout_s: longest wait for the next piece of a request body (408 beyond).
      body_deadline_s: longest time for a whole request body (408 beyond; default 4 x body_timeout_s).
      stall_timeout_s: /health answers 503 once the engine loop has had work and made no progress this long.
      enable_docs: serve /docs, /redoc and /openapi.json.
      protect_metrics: /metrics needs the API key too (when one is set).
      engine_class: builds the engine bridge, `engine_class(make_engine, max_queue=max_queue)`: AsyncEngine (the
        engine on a thread of this process) or an object with its interface (serving/deploy/remote_engine.py:
        the engines on Ray Serve replicas).
    """

    def make_engine():  # on the engine thread, after `state` below exists
        llm = llm_factory()
        engine = llm.engine
        if warmup:
            _smoke_request(engine)
        state.kv_capacity_tokens = _kv_capacity_tokens(engine)
        state.max_token_chars = _max_token_chars(llm.tokenizer)
        state.llm = llm
        return engine

    options = {"stall_timeout_s": stall_timeout_s} if engine_class is AsyncEngine else {}
    engine = engine_class(make_engine, max_queue=max_queue, **options)
    state = ServerState(engine, model_name, api_key, ServerMetrics(engine.live_stats, engine))
    state.max_body_bytes, state.body_timeout_s, state.protect_metrics = max_body_bytes, body_timeout_s, protect_metrics
    state.body_deadline_s = http.default_body_deadline(body_timeout_s) if body_deadline_s is None else body_deadline_s

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        quiet_health_checks()  # here: uvicorn has configured its loggers by now
        engine.start()
        yield
        state.draining = True
        await engine.shutdown()

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    fastapi_app = FastAPI(title="pallas-serve", version="0.1.0", lifespan=lifespan, **docs)
    fastapi_app.state.server = state
    _install_error_handlers(fastapi_app)
    _add_routes(fastapi_app, state)
    _describe_api(fastapi_app, model_name)
    return ServerApp(fastapi_app, state.metrics)


def _describe_api(fastapi_app: FastAPI, model_name: str) -> None:
    """Makes /openapi.json say what this server accepts: the served model name (an enum, so that fuzzers reach
    generation instead of 404s), one example per request, and 400 rather than FastAPI's 422 for bad bodies."""
    examples = {
        "CompletionRequest": {"model": model_name, "prompt": "Hello", "max_tokens": 8},
        "ChatCompletionRequest": {
            "model": model_name,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello"}],
        },
    }

    def openapi() -> dict:
        if fastapi_app.openapi_schema is None:
            schema = FastAPI.openapi(fastapi_app)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            for name, example in examples.items():
                component = schema["components"]["schemas"][name]
                component["properties"]["model"]["enum"] = [model_name]
                component["examples"] = [example]
            for path in schema["paths"].values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            schema["components"]["schemas"].pop("HTTPValidationError", None)
            schema["components"]["schemas"].pop("ValidationError", None)
        return fastapi_app.openapi_schema

    fastapi_app.openapi = openapi


def _kv_capacity_tokens(engine) -> int | None:
    """Token positions one request can hold in the KV pool (None for engines without a paged pool)."""
    kv = getattr(getattr(engine, "scheduler", None), "kv", None)
    if kv is None:
        return None
    return kv.num_usable_blocks * kv.block_size


def _max_token_chars(tokenizer) -> int | None:
    """Most characters of text one token can cover: its vocabulary string's length (byte-level BPE spells each
    byte as one character, so this bounds bytes and characters alike). None when unknown."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return getattr(tokenizer, "max_token_chars", None)
    return max(len(t) for t in hf.get_vocab(with_added_tokens=True))


def _smoke_request(engine) -> None:
    """One short request end to end, and one prompt's logprobs (the engine compiled its step buckets at
    construction when its config's `warmup` asked for it; this compiles the reduction of a logprob chunk)."""
    engine.generate([None], [[0, 1, 2]], max_tokens=2, temperature=0.0)
    if hasattr(engine, "runner"):  # an LLMEngine (data-parallel engines take no prompt-logprob jobs here)
        from serving.engine.scoring import PromptLogprobs  # here: the Ray Serve ingress imports no JAX

        work = PromptLogprobs([0, 1, 2], "warmup-logprobs")
        while not work.done:
            work.advance(engine)


class ServerApp:
    """The ASGI app: FastAPI plus a count of responses by endpoint and status (streamed and error responses
    too). `state.server` is the ServerState."""

    _KNOWN = (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    )

    def __init__(self, inner: FastAPI, metrics: ServerMetrics):
        self.inner, self.metrics = inner, metrics
        self.state = inner.state

    def openapi(self) -> dict:
        return self.inner.openapi()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self._KNOWN else "other"

        async def send_counting(message):
            if message["type"] == "http.response.start":
                self.metrics.observe_request(endpoint, message["status"])
            await send(message)

        await self.inner(scope, receive, send_counting)


def _install_error_handlers(fastapi_app: FastAPI) -> None:
    @fastapi_app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @fastapi_app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        message, param = describe_validation_error(exc.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @fastapi_app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code, headers=exc.headers
        )

    @fastapi_app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"), status_code=500)


# Routes -------------------------------------------------------------------------------------------------------


def _add_routes(fastapi_app: FastAPI, state: ServerState) -> None:
    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise OpenAIError(
                401,
                "Incorrect or missing API key; send `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    auth = [Depends(authorize)]

    async def read(request: Request, model):
        authorize(request)  # before a byte of the body is read
        return await http.read_model(request, model, state.max_body_bytes, state.body_timeout_s, state.body_deadline_s)

    @fastapi_app.get("/health")
    async def health():
        stalled = getattr(state.engine, "stalled", False)
        if state.llm is not None and state.engine.ready and not state.draining and not stalled:
            return {"status": "ok"}
        if stalled:
            seconds = state.engine.stalled_for()
            reason = f"stalled: the engine loop has made no progress for {seconds:.0f} s with work pending"
        else:
            reason = "draining" if state.draining else state.engine.not_ready_reason()
        return JSONResponse({"status": reason}, status_code=503)

    @fastapi_app.get("/metrics")
    async def metrics(request: Request):
        if state.protect_metrics:
            authorize(request)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @fastapi_app.get("/v1/models", dependencies=auth, responses=_ERRORS)
    async def models():
        limit = state.llm.max_model_len if state.llm is not None else None
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pallas-serve",
                    "max_model_len": limit,
                }
            ],
        }

    # vLLM's tokenizer endpoints (lm-eval's "remote" tokenizer backend uses them).
    @fastapi_app.get("/tokenizer_info", dependencies=auth, responses=_ERRORS)
    async def tokenizer_info():
        tok = state.require_ready().tokenizer
        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        return {
            "eos_token": None if eos is None else tok.token_text(eos),
            "bos_token": None if tok.bos_token_id is None else tok.token_text(tok.bos_token_id),
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": state.llm.max_model_len,
        }

    @fastapi_app.post("/tokenize", responses=_ERRORS, openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request):
        body = await read(request, TokenizeRequest)
        llm = state.require_ready()
        check_text(body.prompt, "prompt")
        add_bos = None if body.add_special_tokens else False  # None: the model's own BOS rule
        ids = await asyncio.to_thread(llm.tokenizer.encode, body.prompt, add_bos)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @fastapi_app.post("/detokenize", responses=_ERRORS, openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await read(request, DetokenizeRequest)
        llm = state.require_ready()
        try:
            ids = llm.encode_prompt(body.tokens)
        except ValueError as e:
            raise OpenAIError(400, f"tokens: {e}", param="tokens") from e
        return {"prompt": await asyncio.to_thread(llm.tokenizer.decode, ids)}

    @fastapi_app.post("/v1/completions", responses=_ERRORS, openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        async def run():
            return await handlers.completions(state, await read(request, CompletionRequest), request)

        return await _trimmed(request, run())

    @fastapi_app.post("/v1/chat/completions", responses=_ERRORS, openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        async def run():
            return await handlers.chat(state, await read(request, ChatCompletionRequest), request)

        return await _trimmed(request, run())


def _body_schema(model) -> dict:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def _trimmed(request: Request, handler):
    """Awaits the handler; after a large body, hands the freed heap back to the OS (serving/api/http.py) a
    moment later, once the response and any error holding the parsed body have been dropped."""
    try:
        return await handler
    finally:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > http.LARGE_BODY_BYTES:
            http.schedule_trim()


class DrainingServer(uvicorn.Server):
    """uvicorn server that marks the app as draining (503 for new requests, /health 503) on SIGTERM/SIGINT,
    while uvicorn stops listening and waits for in-flight requests; after a complete drain the process exits 0
    (uvicorn would re-raise the signal and die by it).

    Args:
      config: uvicorn's; its timeout_graceful_shutdown should leave a few seconds past drain_timeout_s.
      drain_timeout_s: how long in-flight requests may run after the signal; then the handlers end them with an
        OpenAI error saying the server is shutting down (streams: an error event and [DONE]). Default: uvicorn's
        timeout_graceful_shutdown less 2 s (unbounded without one).
    """

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float | None = None):
        super().__init__(config)
        grace = config.timeout_graceful_shutdown
        self.drain_timeout_s = (
            drain_timeout_s if drain_timeout_s is not None else (math.inf if grace is None else max(0.0, grace - 2.0))
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    def _state(self) -> ServerState | None:
        return getattr(getattr(self.config.app, "state", None), "server", None)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        state = self._state()
        if state is not None and not state.draining:
            state.draining = True
            if self._loop is not None and math.isfinite(self.drain_timeout_s):
                self._loop.call_soon_threadsafe(self._loop.call_later, self.drain_timeout_s, state.shutdown_now.set)
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's 10 Hz housekeeping; also stops the server when the model failed to load."""
        state = self._state()
        if state is not None and state.engine.load_error is not None:
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if not self.force_exit:
            self._captured_signals.clear()
