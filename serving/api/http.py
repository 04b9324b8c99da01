"""HTTP-level defences of the server: the request body read with a size cap and a read timeout, JSON parsed
with specific errors (and off the event loop when large), uvicorn's h11 protocol with a header read timeout and
OpenAI JSON for malformed requests, and returning freed heap to the OS after large bodies.

    headers --(Content-Length with Transfer-Encoding: 400; a Content-Type that is not JSON: 415; none is fine)-->
    bytes in --(Content-Length > cap: 413 before reading; each chunk within body_timeout_s and the whole body
                within body_deadline_s, else 408; running total > cap: 413)--> UTF-8 (else 400 naming the byte)
             --> json.loads (else 400 with the position; nesting deeper than MAX_JSON_DEPTH: 400; an integer of
                more than MAX_INT_DIGITS digits: 400 naming the field) --> pydantic model (else 400 naming the field)

The per-read timeout alone lets a client trickle one byte every few seconds and hold a connection for hours; the
overall deadline bounds what one body may cost. A request with both Content-Length and Transfer-Encoding is
refused (RFC 9112 6.3: the framing is ambiguous, the classic request-smuggling shape) and its connection closed.

Why trim: a refused large request leaves its body (bytes, str, JSON tree, token-id lists) reachable from the
error's traceback cycle until the cyclic GC runs, and glibc keeps freed memory in its arenas, so after a few
multi-megabyte bodies the RSS stays at the high-water mark. A quarter second after a large request,
`gc.collect()` and `malloc_trim(0)` on a worker thread give the pages back (the trim is glibc only).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import logging
import re
import time
from typing import Any

import h11
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.api.protocol import OpenAIError, describe_validation_error, error_body

log = logging.getLogger("serving.server")

MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 4300  # Python's int <-> str limit (sys.get_int_max_str_digits's default)
LARGE_BODY_BYTES = 1 << 20  # parsed on a worker thread and followed by a heap trim above this


def check_headers(headers) -> None:
    """Refuses ambiguous framing (Content-Length with Transfer-Encoding: 400) and a body that is not JSON (415).
    A missing Content-Type is accepted (the openai client sends JSON; curl -d without -H sends a form type)."""
    if "content-length" in headers and "transfer-encoding" in headers:
        raise OpenAIError(
            400,
            "the request has both Content-Length and Transfer-Encoding; send one of them",
            code="ambiguous_framing",
            headers={"Connection": "close"},
        )
    ctype = headers.get("content-type")
    if ctype is not None:
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise OpenAIError(
                415,
                f"Content-Type {ctype[:100]!r} is not supported; send the body as application/json",
                param="Content-Type",
                code="unsupported_media_type",
            )


async def read_model(
    request: Request, model: type[BaseModel], max_bytes: int, timeout_s: float, deadline_s: float | None = None
) -> BaseModel:
    """The request body as `model`; raises OpenAIError (413, 408, 400) with a message saying what was wrong.

    Args:
      timeout_s: longest wait for the next piece of the body.
      deadline_s: longest time for the whole body (default: 4 x timeout_s).
    """
    body = await read_body(request, max_bytes, timeout_s, deadline_s)
    if len(body) > LARGE_BODY_BYTES:
        return await asyncio.to_thread(parse_model, body, model)
    return parse_model(body, model)


def default_body_deadline(timeout_s: float) -> float:
    return 4.0 * timeout_s


async def read_body(request: Request, max_bytes: int, timeout_s: float, deadline_s: float | None = None) -> bytes:
    check_headers(request.headers)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and len(declared) < 20 and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    deadline_s = default_body_deadline(timeout_s) if deadline_s is None else deadline_s
    end = time.monotonic() + deadline_s
    chunks, total = [], 0
    stream = request.stream().__aiter__()
    while True:
        left = end - time.monotonic()
        overall = left <= timeout_s  # the wait below is cut short by the whole body's deadline
        try:
            if left <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(stream.__anext__(), min(timeout_s, left))
        except StopAsyncIteration:
            break
        except TimeoutError:
            what = f"the whole request body within {deadline_s:g} s (--body_deadline_s)"
            raise OpenAIError(
                408,
                f"the request body did not arrive: {what}"
                if overall
                else f"the request body did not arrive within {timeout_s:g} s (--body_timeout_s)",
                code="body_timeout",
                headers={"Connection": "close"},
            ) from None
        except ClientDisconnect:
            raise OpenAIError(499, "client disconnected", code="client_disconnected") from None
        total += len(chunk)
        if total > max_bytes:
            raise _too_large(total, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body has {'more than ' if size > limit else ''}{size} bytes; this server accepts at most "
        f"{limit} (--max_body_bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def parse_model(body: bytes, model: type[BaseModel]) -> BaseModel:
    obj = parse_json(body)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = describe_validation_error(e.errors(include_url=False))
        raise OpenAIError(400, message, param=param) from None


def parse_json(body: bytes) -> Any:
    if not body:
        raise OpenAIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpenAIError(
            400,
            f"the request body is not valid UTF-8: byte 0x{body[e.start]:02x} at position {e.start}",
            code="invalid_utf8",
        ) from None
    try:
        obj = json.loads(text, parse_int=_parse_int)
    except _HugeInt as e:
        field = _field_before(text, text.find(e.digits))
        raise OpenAIError(
            400,
            f"{field or 'the body'}: an integer of {len(e.digits.lstrip('-'))} digits; at most {MAX_INT_DIGITS} "
            "are accepted",
            param=field,
            code="integer_too_long",
        ) from None
    except RecursionError:
        obj = _TOO_DEEP
    except json.JSONDecodeError as e:
        raise OpenAIError(
            400,
            f"invalid JSON body: {e.msg} at line {e.lineno} column {e.colno} (position {e.pos})",
            code="invalid_json",
        ) from None
    if obj is _TOO_DEEP or not _depth_within(obj, MAX_JSON_DEPTH):
        raise OpenAIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels", code="json_too_deep")
    return obj


_TOO_DEEP = object()


class _HugeInt(Exception):
    def __init__(self, digits: str):
        super().__init__("integer too long")
        self.digits = digits


def _parse_int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS:
        raise _HugeInt(digits)
    return int(digits)


_KEY = re.compile(r'"((?:[^"\\]|\\.){1,256})"\s*:')


def _field_before(text: str, pos: int) -> str | None:
    """The name of the last JSON object key before `pos` (the field a value sits in), or None."""
    keys = _KEY.findall(text, 0, max(pos, 0))
    return keys[-1] if keys else None


def _depth_within(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, dict):
            x = x.values()
        elif not isinstance(x, list):
            continue
        if depth > limit:
            return False
        stack.extend((y, depth + 1) for y in x if isinstance(y, (dict, list)))
    return True


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if ctypes.util.find_library("c") else None


def trim_heap() -> bool:
    """Collects cyclic garbage (an error's traceback keeps the frame that held the body alive until then), then
    returns free heap pages of every malloc arena to the OS (glibc `malloc_trim`); False where unavailable."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


_trim_pending = False


def schedule_trim(delay_s: float = 0.25) -> None:
    """trim_heap() on a worker thread after delay_s (one pending at a time; call on the event loop)."""
    global _trim_pending
    if _trim_pending:
        return
    _trim_pending = True
    loop = asyncio.get_running_loop()

    def start():
        global _trim_pending
        _trim_pending = False
        loop.run_in_executor(None, trim_heap)

    loop.call_later(delay_s, start)


def timed_h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header read timeout (a connection that has not sent a complete request head
    within header_timeout_s of connecting, or of its first bytes, is closed: half-open and slowloris sockets do
    not stay open) and malformed requests answered with an OpenAI JSON 400 instead of plain text."""

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._between_requests():
                self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()  # the keep-alive timeout covers an idle connection from here
            super().on_response_complete()

        def _between_requests(self) -> bool:
            idle = self.cycle is None or self.cycle.response_complete
            return idle and self.conn.their_state is h11.IDLE

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                log.info("closing a connection that sent no complete request head within %.1f s", header_timeout_s)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request: {msg}", code="bad_http_request")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body)):
                self.transport.write(self.conn.send(event))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

    return TimedH11Protocol
