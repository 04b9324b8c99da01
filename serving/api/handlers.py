"""The /v1 completion and chat handlers of the HTTP app (serving/api/app.py routes requests here).

A handler checks what pydantic cannot (serving/api/protocol.py), counts the sequences a request asks for
(prompts x n, or best_of) before encoding anything, tokenises and renders the chat template on a worker thread
(so a large prompt never stalls the event loop), checks the context length, turns the body into SamplingParams
(validated there, once), and submits one engine request per choice to the AsyncEngine. Outputs come back on an
asyncio queue per HTTP request: gathered into one response, or streamed as server-sent events. A client that
disconnects aborts its requests (their KV blocks are freed); past the drain deadline of a shutdown, requests end
with an OpenAI error saying so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
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
from serving.api.formats import (
    ChatFormat,
    Choice,
    CompletionFormat,
    WholePromptScores,
    absorb,
    check_output,
    num_tokens,
    prompt_logprobs,
)
from serving.api.guided import body_constraint, precompile, tool_constraint
from serving.api.metrics import ServerMetrics
from serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    check_text,
    error_body,
    shutting_down_error,
)


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the engine bridge, the loaded LLM (tokenizer, limits) and settings.

    Attributes:
      kv_capacity_tokens: token positions one request can hold in the KV pool (None: unknown).
      shutdown_now: set when the drain deadline of a shutdown has passed.
    """

    engine: AsyncEngine
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    llm: Any = None
    draining: bool = False
    kv_capacity_tokens: int | None = None
    max_token_chars: int | None = None
    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 60.0
    body_deadline_s: float = 240.0
    protect_metrics: bool = False
    shutdown_now: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def require_ready(self):
        if self.llm is None or not self.engine.ready or self.draining:
            if self.draining:
                raise shutting_down_error()
            raise OpenAIError(
                503,
                f"service unavailable: {self.engine.not_ready_reason()}",
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

    def check_text_fits(self, num_chars: int, param: str) -> None:
        """Refuses, without tokenising, a text longer than any max_model_len tokens can spell (each token
        covers at most max_token_chars characters), so a huge prompt costs no tokeniser time."""
        limit = self.llm.max_model_len
        if self.max_token_chars is not None and num_chars > limit * self.max_token_chars:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens; the {param} has {num_chars} characters, "
                f"more than {limit} tokens can hold (at most {self.max_token_chars} characters each)",
                param=param,
                code="context_length_exceeded",
            )

    def check_count(self, num_sequences: int, param: str) -> None:
        """Refuses a request for more sequences than the queue holds, before anything is encoded."""
        if num_sequences > max(1, self.engine.max_queue):
            raise OpenAIError(
                400,
                f"the request asks for {num_sequences} sequences (prompts x {param}); this server queues at "
                f"most {self.engine.max_queue}",
                param=param,
            )


# Completions ---------------------------------------------------------------------------------------------------


def _completion_prompts(llm, prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt of a completions request (on a worker thread)."""
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
    n_seq = body.best_of or body.n
    state.check_count(body.num_prompts() * n_seq, "n" if body.best_of is None else "best_of")
    texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
    for text in texts:
        state.check_text_fits(len(text), "prompt")
    prompts = await asyncio.to_thread(_completion_prompts, llm, body.prompt)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    for _, ids in prompts:
        _check_context(llm, len(ids), max_tokens, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    n_prompt = sum(len(ids) for _, ids in prompts)
    tok = llm.tokenizer
    echo = [(text if text is not None else tok.decode(ids)) if body.echo else "" for text, ids in prompts]
    prompt_lps = None
    if body.echo and body.logprobs is not None:
        prompt_lps = [await _score_prompt(state, llm, ids, body.logprobs, request) for _, ids in prompts]
    fmt = CompletionFormat(rid, state.model_name, tok.token_text, echo, prompt_lps, body.logprobs is not None)
    if max_tokens == 0:  # echo only: the prompt (and its logprobs), nothing generated
        choices = [
            Choice(p * body.n + i, f"{rid}-{p * body.n + i}", p, finish_reason="length")
            for p in range(len(prompts))
            for i in range(body.n)
        ]
        return fmt.response(choices, n_prompt)
    ranked = n_seq > body.n  # best_of: the sampled tokens' logprobs rank the candidates
    logprobs = max(body.logprobs or 0, 0) if ranked else body.logprobs
    params = body.sampling_params(max_tokens, logprobs, llm.config.vocab_size, body_constraint(body)[0])
    await precompile(llm, params)
    choices, specs = _fan_out(rid, prompts, params, n_seq, bool(body.stream))
    stream = await _submit(state, specs, request)
    if body.stream:
        return _sse(state, stream, fmt.chunks(stream, choices, n_prompt, body.include_usage), n_prompt, choices)
    await _collect(state, stream, request, choices, n_prompt)
    if not ranked:
        return fmt.response(choices, n_prompt)
    return fmt.response(best_choices(choices, body.n), n_prompt, num_generated=num_tokens(choices))


def best_choices(choices: list[Choice], n: int) -> list[Choice]:
    """Per prompt, the n candidates with the highest cumulative logprob, re-indexed prompt * n + rank."""
    out = []
    for p in sorted({c.prompt_index for c in choices}):
        ranked = sorted((c for c in choices if c.prompt_index == p), key=lambda c: -c.cumulative_logprob)
        out.extend(dataclasses.replace(c, index=p * n + i) for i, c in enumerate(ranked[:n]))
    return out


async def _score_prompt(state: ServerState, llm, ids: list[int], k: int, request: Request) -> dict:
    """The prompt's logprobs (echo + logprobs): the engine thread computes them a chunk per turn between steps
    (serving/engine/scoring.py PromptLogprobs), so a long prompt never stalls the other requests. A client that
    disconnects, or the drain deadline of a shutdown, cancels the work and frees its KV blocks."""
    if not hasattr(state.engine, "run_job") or not hasattr(llm.engine, "runner"):
        return await _score_whole(state, llm, ids, k)  # Ray Serve ingress, data-parallel engines: whole prompt
    from serving.engine.scoring import PromptLogprobs  # here: the Ray Serve ingress imports this module, not JAX

    work = PromptLogprobs(ids, f"echo-{uuid.uuid4().hex}")
    try:
        scored = await _guarded(state, request, state.engine.run_job(work))
    except ValueError as e:
        raise OpenAIError(400, f"prompt logprobs: {e}", param="prompt") from e
    except (EngineNotReadyError, EngineError) as e:
        raise OpenAIError(503, f"service unavailable: {e}", type="server_error", code="service_unavailable") from e
    return await asyncio.to_thread(prompt_logprobs, scored, k, llm.tokenizer.token_text)


async def _guarded(state: ServerState, request: Request, awaitable):
    """Awaits `awaitable`, cancelling it when the client disconnects (499) or the drain deadline of a shutdown
    passes (503): work that waits in the engine (prompt logprobs, a request parked for a compile) ends with its
    client."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    deadline = asyncio.ensure_future(state.shutdown_now.wait())
    try:
        await asyncio.wait({work, watch, deadline}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            if deadline.done():
                raise shutting_down_error()
            raise OpenAIError(499, "client disconnected", code="client_disconnected")
        return work.result()
    finally:
        for task in (work, watch, deadline):
            task.cancel()


async def _score_whole(state: ServerState, llm, ids: list[int], k: int) -> dict:
    """Prompt logprobs from the whole prompt's logits (llm.score), for engine bridges that run no jobs."""
    try:
        logits = await state.engine.call(lambda: llm.score(list(ids)))
    except (EngineNotReadyError, EngineError) as e:
        raise OpenAIError(503, f"service unavailable: {e}", type="server_error", code="service_unavailable") from e
    return await asyncio.to_thread(prompt_logprobs, WholePromptScores(ids, logits), k, llm.tokenizer.token_text)


# Chat ----------------------------------------------------------------------------------------------------------


def _chat_prompt(llm, body: ChatCompletionRequest, use_tools: bool) -> tuple[str | None, list[int]]:
    """(rendered text or None, token ids) of a chat request (on a worker thread)."""
    if body.prompt_token_ids is not None:
        try:
            return None, llm.encode_prompt(body.prompt_token_ids)
        except ValueError as e:
            raise OpenAIError(400, f"prompt_token_ids: {e}", param="prompt_token_ids") from e
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None
    try:
        text = llm.tokenizer.apply_chat_template(body.template_messages(), tools=tools)
        return text, llm.encode_prompt(text)
    except (ValueError, jinja2.TemplateError) as e:
        raise OpenAIError(400, f"cannot render the chat template: {e}", param="messages") from e


def _default_max_tokens(state: ServerState, llm, prompt_len: int) -> int:
    """Without max_tokens a chat completion may run to the end of the context, clamped to what one request
    can hold in the KV pool (a pool smaller than one full context must not turn the default into a 400)."""
    _check_context(llm, prompt_len, 1, "messages")
    room = llm.max_model_len - prompt_len
    if state.kv_capacity_tokens is not None:
        room = min(room, state.kv_capacity_tokens - prompt_len)
    if room < 1:
        raise OpenAIError(
            400,
            f"the prompt has {prompt_len} tokens and leaves no room for a completion in the KV pool "
            f"({state.kv_capacity_tokens} token positions per request)",
            param="messages",
            code="context_length_exceeded",
        )
    return room


async def chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    llm = state.require_ready()
    state.check_model(body.model)
    state.check_count(body.n, "n")
    constraint, field = body_constraint(body)
    if body.tool_choice is not None and body.tool_choice not in ("none", "auto"):  # required or named: enforced
        if constraint is not None:
            raise OpenAIError(400, f"tool_choice required or named cannot be combined with {field}", param=field)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        constraint = tool_constraint(tools, body.tool_choice, body.parallel_tool_calls)
    use_tools = bool(body.tools) and body.tool_choice != "none"
    state.check_text_fits(sum(len(m.text()) for m in body.messages), "messages")
    text, ids = await asyncio.to_thread(_chat_prompt, llm, body, use_tools)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = requested or _default_max_tokens(state, llm, len(ids))
    _check_context(llm, len(ids), max_tokens, "messages")
    params = body.sampling_params(
        max_tokens, (body.top_logprobs or 0) if body.logprobs else None, llm.config.vocab_size, constraint
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    await precompile(llm, params)
    choices, specs = _fan_out(rid, [(text, ids)], params, body.n, bool(body.stream))
    stream = await _submit(state, specs, request)
    fmt = ChatFormat(rid, state.model_name, llm.tokenizer.token_text, parse_tools=use_tools)
    if body.stream:
        return _sse(state, stream, fmt.chunks(stream, choices, len(ids), body.include_usage), len(ids), choices)
    await _collect(state, stream, request, choices, len(ids))
    return fmt.response(choices, len(ids))


# Shared plumbing -----------------------------------------------------------------------------------------------


def _fan_out(rid: str, prompts, params, n: int, streamed: bool) -> tuple[list[Choice], list[RequestSpec]]:
    """One engine request per (prompt, choice); a seeded request gives choice i the seed + i."""
    choices, specs = [], []
    for p, (text, ids) in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            choices.append(Choice(index, f"{rid}-{index}", p))
            specs.append(RequestSpec(f"{rid}-{index}", ids, seeded, text, streamed))
    return choices, specs


_INTERNAL_ID = re.compile(r"request '[^']*' rejected: |'?(chat)?cmpl-[0-9a-f]{32}(-\d+)?'?\s*")


def public_message(message: str) -> str:
    """An engine message without the server's internal request ids."""
    return _INTERNAL_ID.sub("", message).strip() or "the request was refused"


async def _submit(state: ServerState, specs: list[RequestSpec], request: Request) -> RequestStream:
    """The engine's stream for the specs; a request parked until its shapes compile still ends with its client
    or the drain deadline."""
    state.check_count(len(specs), "n")
    try:
        return await _guarded(state, request, state.engine.submit(specs))
    except QueueFullError as e:
        raise OpenAIError(503, str(e), type="server_error", code="queue_full", headers={"Retry-After": "1"}) from e
    except EngineNotReadyError as e:
        if state.draining:
            raise shutting_down_error() from e
        raise OpenAIError(
            503,
            f"service unavailable: {e}",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": "5"},
        ) from e
    except ValueError as e:
        raise OpenAIError(400, public_message(str(e))) from e
    except EngineError as e:
        raise OpenAIError(500, f"generation failed: {public_message(str(e))}", type="server_error") from e


def _finish_reasons(choices: list[Choice]) -> dict[str, str | None]:
    return {c.request_id: c.finish_reason for c in choices}


async def _collect(
    state: ServerState, stream: RequestStream, request: Request, choices: list[Choice], n_prompt: int
) -> None:
    """Gathers every output of a non-streaming request, aborting it if the client goes away first or the
    drain deadline passes."""
    by_id = {c.request_id: c for c in choices}

    async def gather():
        async for out in stream:
            check_output(out)
            absorb(by_id[out.request_id], out)

    try:
        await _guarded(state, request, gather())
    except EngineError as e:
        raise OpenAIError(500, f"generation failed: {public_message(str(e))}", type="server_error") from e
    finally:
        state.engine.abort(stream)
        state.metrics.observe_stream(stream, n_prompt, _finish_reasons(choices))


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _until_shutdown(chunks: AsyncIterator[dict], shutdown: asyncio.Event) -> AsyncIterator[dict]:
    """The chunks, until the drain deadline passes (then raises shutting_down_error())."""
    deadline = asyncio.ensure_future(shutdown.wait())
    step = None
    try:
        while True:
            step = asyncio.ensure_future(anext(chunks))
            await asyncio.wait({step, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise shutting_down_error()
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:  # also on a client disconnect (Starlette cancels the response): no task is left waiting
        deadline.cancel()
        if step is not None and not step.done():
            step.cancel()


def _sse(
    state: ServerState, stream: RequestStream, chunks: AsyncIterator[dict], n_prompt: int, choices: list[Choice]
) -> StreamingResponse:
    """Server-sent events. A disconnect cancels this generator (Starlette), whose `finally` aborts the request;
    the background task covers a disconnect before the generator ever started. An engine failure or the drain
    deadline ends the stream with an OpenAI error event, then [DONE]."""
    ended = False

    async def end():
        nonlocal ended
        if not ended:
            ended = True
            state.engine.abort(stream)
            state.metrics.observe_stream(stream, n_prompt, _finish_reasons(choices))

    async def events():
        try:
            async for chunk in _until_shutdown(chunks, state.shutdown_now):
                yield _event(chunk)
        except EngineError as e:
            yield _event(error_body(f"generation failed: {public_message(str(e))}", type="server_error"))
        except OpenAIError as e:
            yield _event(e.body())
        finally:
            await end()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        background=BackgroundTask(end),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
