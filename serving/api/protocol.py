"""OpenAI-compatible request models for serving/server.py (responses are built in serving/api/formats.py).

Requests are strict pydantic models: unknown top-level fields, NaN/Infinity, values outside OpenAI's ranges and
wrong JSON types (`"stream": "yes"`, a float token id) are refused with a 400 naming the field, never coerced or
dropped. Their JSON schema is what /openapi.json publishes and what the fuzz test explores. Extensions beyond
OpenAI use vLLM's names (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, and
`prompt_token_ids` on chat: token ids sent instead of `messages`, used as the whole prompt, no template applied;
structured output through `response_format` or guided_json / guided_regex / guided_grammar / guided_choice, turned
into an engine Constraint by serving/api/guided.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serving.core.request import Constraint, SamplingParams


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


def shutting_down_error() -> OpenAIError:
    return OpenAIError(
        503,
        "the server is shutting down; retry on another replica or later",
        type="server_error",
        code="server_shutting_down",
        headers={"Retry-After": "5"},
    )


# What a field accepts, for the message when a value matches no member of its union type.
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids (integers) or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # Accepted and ignored (OpenAI's padding field).


class JsonSchemaFormat(_Strict):
    """response_format.json_schema (OpenAI): the schema the output must validate against."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is required with type 'json_schema' and only with it")
        return self


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
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    # Extensions (vLLM's names).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    # Structured output (serving/api/guided.py): OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1, description="a Lark (llguidance dialect) or GBNF grammar")
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def _logit_bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            token = key.strip()  # ASCII digits only: str.isdigit() is true for "²", which int() refuses
            if not (token.isascii() and token.isdigit() and len(token) <= 12) or not 0 <= int(token) < vocab_size:
                raise OpenAIError(
                    400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key[:40]!r}", param="logit_bias"
                )
            if not -100 <= value <= 100:
                raise OpenAIError(400, f"logit_bias values must be in [-100, 100], got {value!r}", param="logit_bias")
            if value != 0:
                pairs.append((int(token), float(value)))
        return tuple(pairs)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            check_text(s, "stop")
        return tuple(s for s in stops if s)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, vocab_size: int, constraint: Constraint | None = None
    ) -> SamplingParams:
        """Engine parameters (OpenAI defaults: temperature 1, top_p 1); raises OpenAIError when invalid.

        Values the device would overflow on are normalised: top_k >= vocab_size is off, a temperature below
        1e-5 is greedy (as in vLLM), and stop_token_ids and logit_bias keys must be vocabulary ids (logit_bias
        keys are token ids as strings, as in OpenAI's API; values in [-100, 100]).
        """
        logit_bias = self._logit_bias(vocab_size)
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
            constraint=constraint,
            logit_bias=logit_bias,
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
    """POST /v1/completions. `max_tokens` 0 is allowed with `echo` (score the prompt only)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(description=UNION_FIELDS["prompt"])
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_combinations(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo=true (it scores the prompt without generating)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best choices are known only at the end)")
        return self

    def num_prompts(self) -> int:
        """How many prompts the body holds, counted without encoding anything."""
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(max_length=256)
    arguments: str


class ToolCall(_Strict):
    id: str = Field(max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    # Fields that OpenAI responses carry, so a client can send an assistant message back as it received it.
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    annotations: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check_role(self):
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"content must not be null in a {self.role!r} message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(default_factory=list, max_length=4096)
    prompt_token_ids: list[int] | None = Field(
        None, description="extension: the prompt as token ids, instead of messages (no chat template applied)"
    )
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None

    @model_validator(mode="after")
    def _check_prompt(self):
        if bool(self.messages) == (self.prompt_token_ids is not None):
            raise ValueError("send either messages (at least one) or prompt_token_ids, not both")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them; raises OpenAIError for bad content."""
        out = []
        for i, m in enumerate(self.messages):
            text = m.text()
            check_text(text, f"messages[{i}].content")
            role = "system" if m.role == "developer" else m.role
            msg = {"role": role, "content": text} | ({"name": m.name} if m.name else {})
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): text to token ids."""

    model: str | None = Field(None, max_length=1024)
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids to text."""

    model: str | None = Field(None, max_length=1024)
    tokens: list[int] = Field(min_length=1)


def check_text(text: str, param: str) -> None:
    """Rejects strings that are not valid Unicode text (lone surrogates from JSON escapes such as \\udc80)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(400, f"{param} is not valid UTF-8 text: {e.reason} at position {e.start}", param=param) from e


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """One OpenAI-style message (and its `param`) for pydantic's errors: the first error, or, when a value
    matched no member of a union type, what the field accepts."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    leaf = [x for x in loc if not x.isdigit()]
    field = leaf[-2] if len(leaf) >= 2 and leaf[-1] in _TYPE_TAGS else (leaf[-1] if leaf else None)
    tagged = len(loc) > 1 and any(x in _TYPE_TAGS or "[" in x for x in loc)
    if tagged and field in UNION_FIELDS:
        path = ".".join(x for x in loc if x not in _TYPE_TAGS and "[" not in x)
        return f"{path} must be {UNION_FIELDS[field]}; got {_short(e.get('input'))}", path
    param = ".".join(x for x in loc if x not in _TYPE_TAGS and "[" not in x) or None
    if e.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return (msg if e.get("type") == "value_error" else f"the request body must be a JSON object ({msg})"), None
    return f"{param}: {msg}", param


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after", "literal"})


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
