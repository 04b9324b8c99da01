"""OpenAI response bodies and server-sent-event chunks, built from engine outputs (requests: protocol.py).

`CompletionFormat` and `ChatFormat` build the whole response of a finished request, or the chunks of a streamed
one. Usage goes into streams only when the client asked (`stream_options.include_usage`): then every chunk has
`"usage": null` and one extra last chunk carries it, as OpenAI does. With `echo` and `logprobs`, completions
carry the prompt's logprobs (first token: null) ahead of the generated ones.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from serving.api import tools
from serving.api.async_engine import EngineError, RequestStream

# OpenAI's logprob floor for tokens the model gives no probability (JSON has no -Infinity).
MIN_LOGPROB = -9999.0


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


_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class CompletionLogprobs:
    """Accumulates OpenAI completions logprobs ({tokens, token_logprobs, top_logprobs, text_offset})."""

    def __init__(self, token_text, offset: int = 0):
        self._token_text = token_text
        self._offset = offset

    def block(self, token_ids: Sequence[int], entries: Sequence[Any]) -> dict:
        out = {k: [] for k in _KEYS}
        for tid, (lp, top) in zip(token_ids, entries):
            text = self._token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(finite_logprob(lp))
            out["top_logprobs"].append({self._token_text(i): finite_logprob(v) for i, v in top})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    @staticmethod
    def merge(blocks: Sequence[dict | None]) -> dict | None:
        blocks = [b for b in blocks if b is not None]
        if not blocks:
            return None
        return {k: [x for b in blocks for x in b[k]] for k in _KEYS}


class WholePromptScores:
    """PromptLogprobs' fields from a whole prompt's logits [>= len(ids), V] (engine bridges without jobs)."""

    def __init__(self, ids: Sequence[int], logits_lv):
        self.ids = list(ids)
        x = np.asarray(logits_lv[: max(len(ids) - 1, 0)], np.float64)
        logp = x - x.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        self.token_logprobs = logp[np.arange(len(x)), self.ids[1:]]
        self.top_ids = np.argsort(-logp, axis=-1)[:, :20]
        self.top_logprobs = np.take_along_axis(logp, self.top_ids, axis=-1)


def prompt_logprobs(scored, k: int, token_text) -> dict:
    """Completions logprobs of a prompt scored by teacher forcing (serving/engine/scoring.py PromptLogprobs:
    `ids`, `token_logprobs`, `top_ids`, `top_logprobs`): token i's logprob under the logits at i - 1 (the first
    token has none: null, as in OpenAI), with the k most likely tokens at each position."""
    out = {key: [] for key in _KEYS}
    offset = 0
    for i, tid in enumerate(scored.ids):
        text = token_text(tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if i == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(finite_logprob(float(scored.token_logprobs[i - 1])))
        ids, lps = scored.top_ids[i - 1, :k], scored.top_logprobs[i - 1, :k]
        out["top_logprobs"].append({token_text(int(t)): finite_logprob(float(v)) for t, v in zip(ids, lps)})
    return out


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


# Choices -----------------------------------------------------------------------------------------------------


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

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for lp, _ in self.logprobs)


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


def _with_usage(chunk: dict, include_usage: bool) -> dict:
    return chunk | {"usage": None} if include_usage else chunk


# Completions -------------------------------------------------------------------------------------------------


class CompletionFormat:
    """Args: echo: per prompt, the text to put ahead of the completion ('' without echo); prompt_lps: per prompt,
    its logprobs block (echo + logprobs) or None; want_logprobs: whether the client asked for logprobs (best_of
    requests them internally to rank choices)."""

    def __init__(self, rid: str, model: str, token_text, echo: list[str], prompt_lps=None, want_logprobs=True):
        self.rid, self.model, self.token_text, self.echo = rid, model, token_text, echo
        self.prompt_lps = prompt_lps or [None] * len(echo)
        self.want_logprobs = want_logprobs
        self.created = envelope(rid, "", model)["created"]

    def _head(self) -> dict:
        return envelope(self.rid, "text_completion", self.model, self.created)

    def _logprobs(self, c: Choice, token_ids, entries, first: bool) -> dict | None:
        if not self.want_logprobs:
            return None
        p = c.prompt_index
        gen = CompletionLogprobs(self.token_text, len(self.echo[p])).block(token_ids, entries) if entries else None
        return CompletionLogprobs.merge([self.prompt_lps[p] if first else None, gen])

    def response(self, choices: list[Choice], n_prompt: int, num_generated: int | None = None) -> dict:
        out = self._head()
        out["choices"] = []
        for c in choices:
            out["choices"].append(
                {
                    "index": c.index,
                    "text": self.echo[c.prompt_index] + "".join(c.text),
                    "logprobs": self._logprobs(c, c.token_ids, c.logprobs, True),
                    "finish_reason": c.finish_reason,
                }
            )
        out["usage"] = usage(n_prompt, num_tokens(choices) if num_generated is None else num_generated)
        return out

    async def chunks(
        self, stream: RequestStream, choices: list[Choice], n_prompt: int, include_usage: bool
    ) -> AsyncIterator[dict]:
        by_id = {c.request_id: c for c in choices}
        async for out in stream:
            c = by_id[out.request_id]
            check_output(out)
            absorb(c, out)
            lp = self._logprobs(c, out.new_token_ids, out.new_logprobs, not c.started)
            text = ("" if c.started else self.echo[c.prompt_index]) + out.text
            if not (text or lp or out.finished):
                continue
            c.started = True
            chunk = self._head()
            chunk["choices"] = [{"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}]
            yield _with_usage(chunk, include_usage)
        if include_usage:
            yield self._head() | {"choices": [], "usage": usage(n_prompt, num_tokens(choices))}


# Chat --------------------------------------------------------------------------------------------------------


class ChatFormat:
    """Args: parse_tools: the request offered tools (tool_choice not 'none'): `<tool_call>` blocks of the output
    become `tool_calls` (serving/api/tools.py)."""

    def __init__(self, rid: str, model: str, token_text, parse_tools: bool = False):
        self.rid, self.model, self.token_text, self.parse_tools = rid, model, token_text, parse_tools
        self.created = envelope(rid, "", model)["created"]

    def _head(self, obj: str) -> dict:
        return envelope(self.rid, obj, self.model, self.created)

    def _message(self, c: Choice) -> tuple[dict, str | None]:
        text = "".join(c.text)
        if self.parse_tools:
            content, calls = tools.parse_tool_calls(text, f"{self.rid}-{c.index}")
            if calls:
                return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, c.finish_reason

    def response(self, choices: list[Choice], n_prompt: int) -> dict:
        out = self._head("chat.completion")
        out["choices"] = []
        for c in choices:
            message, reason = self._message(c)
            lp = {"content": chat_logprobs(self.token_text, c.token_ids, c.logprobs)} if c.logprobs else None
            out["choices"].append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason})
        out["usage"] = usage(n_prompt, num_tokens(choices))
        return out

    async def chunks(
        self, stream: RequestStream, choices: list[Choice], n_prompt: int, include_usage: bool
    ) -> AsyncIterator[dict]:
        by_id = {c.request_id: c for c in choices}
        held = {c.request_id: tools.StreamHoldback() if self.parse_tools else None for c in choices}
        head = self._head("chat.completion.chunk")
        first = [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for c in choices
        ]
        yield _with_usage(head | {"choices": first}, include_usage)
        async for out in stream:
            c = by_id[out.request_id]
            check_output(out)
            absorb(c, out)
            lp = chat_logprobs(self.token_text, out.new_token_ids, out.new_logprobs) if out.new_logprobs else None
            text, delta, reason = out.text, {}, c.finish_reason
            if held[c.request_id] is not None:
                text = held[c.request_id].feed(out.text, out.finished)
                if out.finished:
                    _, calls = tools.parse_tool_calls("".join(c.text), f"{self.rid}-{c.index}")
                    if calls:
                        delta["tool_calls"] = [call | {"index": i} for i, call in enumerate(calls)]
                        reason = "tool_calls"
            if text:
                delta["content"] = text
            if not (delta or lp or out.finished):
                continue
            choice = {"index": c.index, "delta": delta, "logprobs": {"content": lp} if lp else None}
            yield _with_usage(dict(head) | {"choices": [choice | {"finish_reason": reason}]}, include_usage)
        if include_usage:
            yield head | {"choices": [], "usage": usage(n_prompt, num_tokens(choices))}
