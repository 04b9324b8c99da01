"""The /v1 completion and chat handlers of the HTTP app (serving/api/app.py routes requests here).

A handler validates what pydantic cannot (serving/api/protocol.py), tokenises, checks the context length, turns
the body into SamplingParams (validated there, once), and submits one engine request per choice to the
AsyncEngine. Outputs come back on an asyncio queue per HTTP request: gathered into one response, or streamed as
server-sent events. A client that disconnects aborts its requests (their KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from serving.api.async_engine import (
    AsyncEngine,
    EngineError,
    EngineNotReadyError,
    QueueFullError,
    RequestSpec,
    RequestStream,
)
from serving.api.metrics import ServerMetrics
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


async def completions(state: ServerState, body: CompletionRequest, request: Request):
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


async def chat(state: ServerState, body: ChatCompletionRequest, request: Request):
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
