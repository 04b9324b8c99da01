"""OpenAI-compatible request models and response builders for serving/server.py.

Requests are pydantic models that reject unknown top-level fields (as OpenAI does), NaN/Infinity and values
outside OpenAI's ranges; their JSON schema is what /openapi.json publishes and what the fuzz test explores.
Extensions beyond OpenAI use vLLM's names (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids). Responses are plain dicts in OpenAI's shapes: `CompletionFormat` and `ChatFormat` build the
whole response of a finished request, or the server-sent-event chunks of a streamed one from engine outputs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.api.async_engine import EngineError, RequestStream
from serving.core.request import SamplingParams

# OpenAI's logprob floor for tokens the model gives no probability (JSON has no -Infinity).
MIN_LOGPROB = -9999.0


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # Accepted and ignored (OpenAI's padding field).


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str = Field(max_length=1024)
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = Field(None, max_length=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            check_text(s, "stop")
        return tuple(s for s in stops if s)

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
        """Engine parameters (OpenAI defaults: temperature 1, top_p 1); raises OpenAIError when invalid.

        Values the device would overflow on are normalised: top_k >= vocab_size is off, a temperature below
        1e-5 is greedy (as in vLLM), and stop_token_ids must be vocabulary ids.
        """
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        bad = [t for t in self.stop_token_ids or () if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(400, f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}", param="stop_token_ids")
        top_k = _default(self.top_k, 0)
        temperature = _default(self.temperature, 1.0)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < 1e-5 else temperature,
            top_p=_default(self.top_p, 1.0),
            top_k=0 if top_k < 0 or top_k >= vocab_size else top_k,
            min_p=_default(self.min_p, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            seed=self.seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        try:
            return params.validate()
        except ValueError as e:
            raise OpenAIError(400, str(e), param=str(e).split(" ", 1)[0]) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _default(value, default):
    return default if value is None else value


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists"
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    # Fields that OpenAI responses carry, so a client can send an assistant message back as it received it.
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    annotations: list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template wants them; raises OpenAIError for unsupported or bad content."""
        if self.tools:
            raise OpenAIError(400, "tools are not supported by this server", param="tools")
        out = []
        for i, m in enumerate(self.messages):
            text = m.text()
            check_text(text, f"messages[{i}].content")
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": text} | ({"name": m.name} if m.name else {}))
        return out


def check_text(text: str, param: str) -> None:
    """Rejects strings that are not valid Unicode text (lone surrogates from JSON escapes such as \\udc80)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(400, f"{param} is not valid UTF-8 text: {e.reason} at position {e.start}", param=param) from e


# Responses ----------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(rid: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def finite_logprob(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


class CompletionLogprobs:
    """Accumulates OpenAI completions logprobs ({tokens, token_logprobs, top_logprobs, text_offset})."""

    def __init__(self, token_text, offset: int = 0):
        self._token_text = token_text
        self._offset = offset

    def block(self, token_ids: Sequence[int], entries: Sequence[Any]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, (lp, top) in zip(token_ids, entries):
            text = self._token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(finite_logprob(lp))
            out["top_logprobs"].append({self._token_text(i): finite_logprob(v) for i, v in top})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    @staticmethod
    def merge(blocks: Sequence[dict]) -> dict | None:
        if not blocks:
            return None
        return {
            k: [x for b in blocks for x in b[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }


def chat_logprobs(token_text, token_ids: Sequence[int], entries: Sequence[Any]) -> list[dict]:
    """OpenAI chat `logprobs.content` entries for generated tokens."""
    content = []
    for tid, (lp, top) in zip(token_ids, entries):
        text = token_text(tid)
        content.append(
            {
                "token": text,
                "logprob": finite_logprob(lp),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": token_text(i), "logprob": finite_logprob(v), "bytes": list(token_text(i).encode("utf-8"))}
                    for i, v in top
                ],
            }
        )
    return content


# Choices and response formats ------------------------------------------------------------------------------


@dataclasses.dataclass
class Choice:
    """One sequence of a response: an engine request and what it has produced so far."""

    index: int
    request_id: str
    prompt_index: int
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # a stream chunk has been sent for this choice


def check_output(out) -> None:
    if out.finish_reason == "error":
        raise EngineError(out.finish_message or "the engine failed this request")


def absorb(c: Choice, out) -> None:
    c.text.append(out.text)
    c.token_ids.extend(out.new_token_ids)
    if out.new_logprobs:
        c.logprobs.extend(out.new_logprobs)
    if out.finished:
        c.finish_reason = out.finish_reason


def num_tokens(choices: list[Choice]) -> int:
    return sum(len(c.token_ids) for c in choices)


def attach_usage(chunk: dict, stream: RequestStream, choices, n_prompt: int, include_usage: bool) -> None:
    """OpenAI puts usage only in the extra last chunk (include_usage); we also put it in the chunk that ends
    the stream, so that clients without stream_options see it."""
    chunk["usage"] = None
    if stream.finished and not include_usage:
        chunk["usage"] = usage(n_prompt, num_tokens(choices))


class CompletionFormat:
    def __init__(self, rid: str, model: str, token_text, echo: list[str]):
        self.rid, self.model, self.token_text, self.echo = rid, model, token_text, echo
        self.created = envelope(rid, "", model)["created"]

    def _head(self) -> dict:
        return envelope(self.rid, "text_completion", self.model, self.created)

    def response(self, choices: list[Choice], n_prompt: int) -> dict:
        out = self._head()
        out["choices"] = []
        for c in choices:
            lp = CompletionLogprobs(self.token_text).block(c.token_ids, c.logprobs) if c.logprobs else None
            out["choices"].append(
                {
                    "index": c.index,
                    "text": self.echo[c.prompt_index] + "".join(c.text),
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
            )
        out["usage"] = usage(n_prompt, sum(len(c.token_ids) for c in choices))
        return out

    async def chunks(
        self, stream: RequestStream, choices: list[Choice], n_prompt: int, include_usage: bool
    ) -> AsyncIterator[dict]:
        by_id = {c.request_id: c for c in choices}
        lps = {c.request_id: CompletionLogprobs(self.token_text) for c in choices}
        async for out in stream:
            c = by_id[out.request_id]
            check_output(out)
            absorb(c, out)
            lp = lps[c.request_id].block(out.new_token_ids, out.new_logprobs) if out.new_logprobs else None
            text = ("" if c.started else self.echo[c.prompt_index]) + out.text
            if not (text or lp or out.finished):
                continue
            c.started = True
            chunk = self._head()
            chunk["choices"] = [{"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}]
            attach_usage(chunk, stream, choices, n_prompt, include_usage)
            yield chunk
        if include_usage:
            yield self._head() | {"choices": [], "usage": usage(n_prompt, num_tokens(choices))}


class ChatFormat:
    def __init__(self, rid: str, model: str, token_text):
        self.rid, self.model, self.token_text = rid, model, token_text
        self.created = envelope(rid, "", model)["created"]

    def _head(self, obj: str) -> dict:
        return envelope(self.rid, obj, self.model, self.created)

    def response(self, choices: list[Choice], n_prompt: int) -> dict:
        out = self._head("chat.completion")
        out["choices"] = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": {"content": chat_logprobs(self.token_text, c.token_ids, c.logprobs)}
                if c.logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        out["usage"] = usage(n_prompt, num_tokens(choices))
        return out

    async def chunks(
        self, stream: RequestStream, choices: list[Choice], n_prompt: int, include_usage: bool
    ) -> AsyncIterator[dict]:
        by_id = {c.request_id: c for c in choices}
        head = self._head("chat.completion.chunk")
        yield head | {
            "choices": [
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in choices
            ]
        }
        async for out in stream:
            c = by_id[out.request_id]
            check_output(out)
            absorb(c, out)
            lp = (
                {"content": chat_logprobs(self.token_text, out.new_token_ids, out.new_logprobs)}
                if out.new_logprobs
                else None
            )
            if not (out.text or lp or out.finished):
                continue
            chunk = dict(head)
            chunk["choices"] = [
                {
                    "index": c.index,
                    "delta": {"content": out.text} if out.text else {},
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
            ]
            attach_usage(chunk, stream, choices, n_prompt, include_usage)
            yield chunk
        if include_usage:
            yield head | {"choices": [], "usage": usage(n_prompt, num_tokens(choices))}
