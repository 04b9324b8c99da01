"""The OpenAI-compatible HTTP app: FastAPI + uvicorn over the continuous-batching engine (binary: serving/server.py).

Endpoints: POST /v1/completions, POST /v1/chat/completions (server-sent events with `stream`), GET /v1/models,
GET /health (200 once the model is loaded and compiled, 503 before and while draining), GET /metrics
(Prometheus text).

Request flow: a handler validates the body (pydantic, serving/api/protocol.py), tokenises, checks the context
length, and submits one engine request per choice to the AsyncEngine, whose thread owns the LLMEngine. Outputs
come back on an asyncio queue per HTTP request. A client that disconnects aborts its requests (their KV blocks
are freed). SIGTERM stops accepting connections, lets in-flight requests finish (up to --drain_timeout_s), then
stops the engine thread and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import jinja2
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api.async_engine import (
    AsyncEngine,
    EngineError,
    EngineNotReadyError,
    QueueFullError,
    RequestSpec,
    RequestStream,
)
from serving.api.metrics import CONTENT_TYPE, ServerMetrics
from serving.api.protocol import (
    ChatCompletionRequest,
    ChatFormat,
    Choice,
    CompletionFormat,
    CompletionRequest,
    OpenAIError,
    absorb,
    check_output,
    check_text,
    error_body,
)

log = logging.getLogger("serving.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_ERRORS = {
    400: {"description": "invalid request"},
    401: {"description": "missing or wrong API key"},
    404: {"description": "unknown model"},
    503: {"description": "loading, draining or queue full"},
}


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the engine bridge, the loaded LLM (tokenizer, limits) and settings."""

    engine: AsyncEngine
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    llm: Any = None
    draining: bool = False

    def require_ready(self):
        if self.llm is None or not self.engine.ready or self.draining:
            reason = "the server is shutting down" if self.draining else self.engine.not_ready_reason()
            raise OpenAIError(
                503,
                f"service unavailable: {reason}",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": "5"},
            )
        return self.llm

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                param="model",
                code="model_not_found",
            )


# Application ---------------------------------------------------------------------------------------------------


def create_app(
    llm_factory: Callable[[], Any],
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    api_key: str | None = None,
    max_queue: int = 256,
    warmup: bool = True,
) -> ServerApp:
    """Builds the ASGI app; the engine thread starts (and loads the model) with the app's lifespan.

    Args:
      llm_factory: returns a serving.engine.llm.LLM (called on the engine thread, so loading does not block /health).
      model_name: the name clients must pass as `model`.
      api_key: when set, /v1 requests need `Authorization: Bearer <api_key>`.
      max_queue: most requests waiting for a slot before new ones get 503.
      warmup: compile every step bucket before reporting healthy.
    """

    def make_engine():  # on the engine thread, after `state` below exists
        llm = llm_factory()
        engine = llm.engine
        if warmup:
            _warmup(engine)
        state.llm = llm
        return engine

    engine = AsyncEngine(make_engine, max_queue=max_queue)
    state = ServerState(engine, model_name, api_key, ServerMetrics(lambda: engine.stats))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        state.draining = True
        await engine.shutdown()

    fastapi_app = FastAPI(title="pallas-serve", version="0.1.0", lifespan=lifespan)
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


def _warmup(engine) -> None:
    """Compiles every step bucket and the sampler, then runs one short request end to end."""
    engine.warmup()
    engine.generate([None], [[0, 1, 2]], max_tokens=2, temperature=0.0)


class ServerApp:
    """The ASGI app: FastAPI plus a count of responses by endpoint and status (streamed and error responses
    too). `state.server` is the ServerState."""

    _KNOWN = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

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
        message, param = _describe_validation_error(exc.errors())
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


def _describe_validation_error(errors) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"invalid JSON body: {e.get('ctx', {}).get('error', 'decode error')} at position {loc[0]}", None
    param = ".".join(loc) or None
    if e.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if param is None:
        return f"the request body must be a JSON object ({e.get('msg')})", None
    return f"{param}: {e.get('msg')}", param


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

    @fastapi_app.get("/health")
    async def health():
        if state.llm is not None and state.engine.ready and not state.draining:
            return {"status": "ok"}
        reason = "draining" if state.draining else state.engine.not_ready_reason()
        return JSONResponse({"status": reason}, status_code=503)

    @fastapi_app.get("/metrics")
    async def metrics():
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

    @fastapi_app.post("/v1/completions", dependencies=auth, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        return await _completions(state, body, request)

    @fastapi_app.post("/v1/chat/completions", dependencies=auth, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _chat(state, body, request)


# Completions ---------------------------------------------------------------------------------------------------


def _completion_prompts(llm, prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt of a completions request."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            check_text(p, "prompt")
        try:
            out.append((p if isinstance(p, str) else None, llm.encode_prompt(p)))
        except ValueError as e:
            raise OpenAIError(400, f"prompt {i}: {e}", param="prompt") from e
    return out


def _check_context(llm, prompt_len: int, max_tokens: int, param: str) -> None:
    limit = llm.max_model_len
    if prompt_len + max_tokens > limit:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=param,
            code="context_length_exceeded",
        )


async def _completions(state: ServerState, body: CompletionRequest, request: Request):
    llm = state.require_ready()
    state.check_model(body.model)
    if body.suffix:
        raise OpenAIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise OpenAIError(400, "best_of must equal n (best-of reranking is not supported)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise OpenAIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")
    prompts = _completion_prompts(llm, body.prompt)
    max_tokens = body.max_tokens or 16
    for _, ids in prompts:
        _check_context(llm, len(ids), max_tokens, "prompt")
    params = body.sampling_params(max_tokens, body.logprobs, llm.config.vocab_size)
    rid = f"cmpl-{uuid.uuid4().hex}"
    choices, specs = _fan_out(rid, prompts, params, body.n)
    stream = await _submit(state, specs)
    n_prompt = sum(len(ids) for _, ids in prompts)
    echo = [(text if text is not None else llm.tokenizer.decode(ids)) if body.echo else "" for text, ids in prompts]
    fmt = CompletionFormat(rid, state.model_name, llm.tokenizer.token_text, echo)
    if body.stream:
        return _sse(state, stream, fmt.chunks(stream, choices, n_prompt, body.include_usage), n_prompt, choices)
    await _collect(state, stream, request, choices, n_prompt)
    return fmt.response(choices, n_prompt)


# Chat ----------------------------------------------------------------------------------------------------------


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    llm = state.require_ready()
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    try:
        text = llm.tokenizer.apply_chat_template(body.template_messages())
        ids = llm.encode_prompt(text)
    except (ValueError, jinja2.TemplateError) as e:
        raise OpenAIError(400, f"cannot render the chat template: {e}", param="messages") from e
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = requested or max(1, llm.max_model_len - len(ids))
    _check_context(llm, len(ids), max_tokens, "messages")
    params = body.sampling_params(
        max_tokens, (body.top_logprobs or 0) if body.logprobs else None, llm.config.vocab_size
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    choices, specs = _fan_out(rid, [(text, ids)], params, body.n)
    stream = await _submit(state, specs)
    fmt = ChatFormat(rid, state.model_name, llm.tokenizer.token_text)
    if body.stream:
        return _sse(state, stream, fmt.chunks(stream, choices, len(ids), body.include_usage), len(ids), choices)
    await _collect(state, stream, request, choices, len(ids))
    return fmt.response(choices, len(ids))


# Shared plumbing -----------------------------------------------------------------------------------------------


def _fan_out(rid: str, prompts, params, n: int) -> tuple[list[Choice], list[RequestSpec]]:
    """One engine request per (prompt, choice); a seeded request gives choice i the seed + i."""
    choices, specs = [], []
    for p, (text, ids) in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            choices.append(Choice(index, f"{rid}-{index}", p))
            specs.append(RequestSpec(f"{rid}-{index}", ids, seeded, text))
    return choices, specs


async def _submit(state: ServerState, specs: list[RequestSpec]) -> RequestStream:
    if len(specs) > max(1, state.engine.max_queue):
        raise OpenAIError(
            400,
            f"the request asks for {len(specs)} sequences (prompts x n); this server queues at "
            f"most {state.engine.max_queue}",
            param="n",
        )
    try:
        return await state.engine.submit(specs)
    except QueueFullError as e:
        raise OpenAIError(503, str(e), type="server_error", code="queue_full", headers={"Retry-After": "1"}) from e
    except EngineNotReadyError as e:
        raise OpenAIError(
            503,
            f"service unavailable: {e}",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": "5"},
        ) from e
    except ValueError as e:
        raise OpenAIError(400, str(e)) from e
    except EngineError as e:
        raise OpenAIError(500, f"generation failed: {e}", type="server_error", code="engine_error") from e


def _finish_reasons(choices: list[Choice]) -> dict[str, str | None]:
    return {c.request_id: c.finish_reason for c in choices}


async def _collect(
    state: ServerState, stream: RequestStream, request: Request, choices: list[Choice], n_prompt: int
) -> None:
    """Gathers every output of a non-streaming request, aborting it if the client goes away first."""
    by_id = {c.request_id: c for c in choices}

    async def gather():
        async for out in stream:
            check_output(out)
            absorb(by_id[out.request_id], out)

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise OpenAIError(499, "client disconnected", code="client_disconnected")
        work.result()
    except EngineError as e:
        raise OpenAIError(500, f"generation failed: {e}", type="server_error", code="engine_error") from e
    finally:
        watch.cancel()
        work.cancel()
        state.engine.abort(stream)
        state.metrics.observe_stream(stream, n_prompt, _finish_reasons(choices))


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(
    state: ServerState, stream: RequestStream, chunks: AsyncIterator[dict], n_prompt: int, choices: list[Choice]
) -> StreamingResponse:
    """Server-sent events. A disconnect cancels this generator (Starlette), whose `finally` aborts the request;
    the background task covers a disconnect before the generator ever started."""
    ended = False

    async def end():
        nonlocal ended
        if not ended:
            ended = True
            state.engine.abort(stream)
            state.metrics.observe_stream(stream, n_prompt, _finish_reasons(choices))

    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except EngineError as e:
            body = error_body(f"generation failed: {e}", type="server_error", code="engine_error")
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            await end()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        background=BackgroundTask(end),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class DrainingServer(uvicorn.Server):
    """uvicorn server that marks the app as draining (503 for new requests, /health 503) on SIGTERM/SIGINT,
    while uvicorn stops listening and waits for in-flight requests; after a complete drain the process exits 0
    (uvicorn would re-raise the signal and die by it)."""

    def _state(self) -> ServerState | None:
        return getattr(getattr(self.config.app, "state", None), "server", None)

    def handle_exit(self, sig, frame) -> None:
        if self._state() is not None:
            self._state().draining = True
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
