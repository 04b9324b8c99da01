"""Request state shared by the scheduler and the engine (pure Python, no JAX).

Data flow: the engine builds a `Request` from a prompt's token ids and a validated `SamplingParams`, hands it
to `Scheduler.add_request`, and from then on the scheduler owns its mutable state:

    prompt_token_ids + output_token_ids == all_token_ids        (num_tokens of them)
    |<------------ num_computed_tokens ------------>|<- to compute ->|
    KV of these positions is in the request's blocks  scheduled in later steps

`num_computed_tokens` only counts positions whose KV is written. A sampled token is appended to the outputs
before its KV exists, so during decoding `num_tokens - num_computed_tokens == 1`; the next step computes it and
samples the following token. Prefill chunks, prefix-cache hits, decode rows, speculative verification and
recomputation after a preemption are all the same arithmetic on these two numbers. With draft tokens
(`spec_token_ids`) a decode row computes 1 + len(drafts) positions; the KV of the drafts is provisional until
`update` accepts some of them, and `num_computed_tokens` then counts only the accepted ones:

    start = num_computed_tokens          this step: [t0 d1 d2 d3] at start .. start+3
    accepted d1, bonus token b           outputs += [d1, b]; num_computed_tokens = start + 2 (t0, d1 written)

`RequestOutput` is what the engine streams back per step; detokenisation (the text delta) and stop strings are
the engine's job, token-level stop conditions are the scheduler's.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]
ConstraintKind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]
_CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
_MAX_CONSTRAINT_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A structured-output constraint: every output token must keep the text a prefix of the language, and the
    output ends (EOS) only where the language accepts. Compiled by serving/engine/structured.py (llguidance).

    Attributes:
        kind: 'json_object' (any JSON object), 'json_schema', 'regex', 'grammar' (Lark, or GBNF converted to
            Lark) or 'choice' (one of a list of strings).
        spec: json_schema: the schema as JSON text; regex: the pattern; grammar: the grammar source; choice: a
            JSON list of strings; json_object: empty.
    """

    kind: ConstraintKind
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> Constraint:
        """From a schema object (key order kept: it is the order properties are generated in) or its JSON."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))

    def validate(self) -> Constraint:
        """Checks the form (what the grammar compiler checks comes later, in the engine); returns self.

        Raises:
            ValueError: naming the constraint field.
        """
        _check(self.kind in _CONSTRAINT_KINDS, f"constraint.kind must be one of {_CONSTRAINT_KINDS}, got {self.kind!r}")
        _check(isinstance(self.spec, str), f"constraint.spec must be a string, got {type(self.spec).__name__}")
        _check(
            len(self.spec) <= _MAX_CONSTRAINT_CHARS,
            f"constraint.spec is {len(self.spec)} characters; at most {_MAX_CONSTRAINT_CHARS} are accepted",
        )
        if self.kind == "json_object":
            _check(not self.spec, "constraint.spec must be empty for kind 'json_object'")
            return self
        _check(bool(self.spec), f"constraint.spec must not be empty for kind {self.kind!r}")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as e:
                raise ValueError(f"constraint.spec of kind {self.kind!r} is not valid JSON: {e}") from None
            if self.kind == "json_schema":
                _check(
                    isinstance(value, (dict, bool)),
                    f"constraint.spec: a JSON schema must be an object or a boolean, got {type(value).__name__}",
                )
            else:
                _check(
                    isinstance(value, list) and value and all(isinstance(v, str) and v for v in value),
                    "constraint.spec: choice must be a non-empty JSON list of non-empty strings",
                )
        return self


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options (OpenAI / vLLM semantics).

    Attributes:
        max_tokens: most output tokens to generate (at least 1). Each entry point has one default: 16 here and
            in OpenAI /v1/completions (OpenAI's), what the context holds in /v1/chat/completions, 64 in
            `LLM.generate` and `python -m serving.generate`; a row also stops at the context length.
        temperature: 0 means greedy; larger flattens the distribution.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens whose probability is below min_p * max probability; 0 disables it.
        repetition_penalty: HF-style multiplicative penalty (> 0) on tokens already seen; 1 disables it.
        presence_penalty: OpenAI additive penalty in [-2, 2] on tokens present in the output.
        frequency_penalty: OpenAI additive penalty in [-2, 2] scaled by output counts.
        seed: per-request RNG seed; None draws from the engine's stream.
        stop: stop strings, matched by the engine on the detokenised text.
        stop_token_ids: extra token ids that end generation (besides EOS), checked by the scheduler.
        min_tokens: EOS and stop_token_ids do not end generation before this many outputs.
        ignore_eos: keep generating through EOS (stop_token_ids still apply).
        logprobs: number of top logprobs to return per output token; None disables them.
        constraint: structured output (JSON schema, regex, grammar, ...); None: unconstrained.
        logit_bias: (token id, bias) pairs added to the logits before sampling (OpenAI semantics: bias in
            [-100, 100]; -100 bans a token in effect, +100 all but forces it); the logprobs reported are those of
            the biased distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def validate(self) -> SamplingParams:
        """Checks every field; returns self so that calls chain.

        Raises:
            ValueError: naming the offending field and value.
        """
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _finite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}",
        )
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer or None, got {self.seed!r}")
        _check(
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a tuple of non-empty strings, got {self.stop!r}",
        )
        _check(
            isinstance(self.stop_token_ids, tuple) and all(_is_token(t) for t in self.stop_token_ids),
            f"stop_token_ids must be a tuple of non-negative ints, got {self.stop_token_ids!r}",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            f"logprobs must be None or an integer >= 0, got {self.logprobs!r}",
        )
        _check(
            isinstance(self.logit_bias, tuple)
            and len(self.logit_bias) <= MAX_LOGIT_BIAS
            and all(
                isinstance(e, tuple) and len(e) == 2 and _is_token(e[0]) and _finite(e[1]) and -100 <= e[1] <= 100
                for e in self.logit_bias
            ),
            f"logit_bias must be at most {MAX_LOGIT_BIAS} (token id >= 0, bias in [-100, 100]) pairs, "
            f"got {self.logit_bias!r}",
        )
        if self.constraint is not None:
            _check(
                isinstance(self.constraint, Constraint),
                f"constraint must be a serving.core.request.Constraint or None, got {type(self.constraint).__name__}",
            )
            self.constraint.validate()
            _check(not self.ignore_eos, "ignore_eos cannot be combined with a constraint (the grammar decides the end)")
        return self


def prompt_token_ids(ids: Sequence[Any], vocab_size: int) -> list[int]:
    """A prompt's token ids as ints, refused (ValueError) when empty or outside [0, vocab_size)."""
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> PREEMPTED -> RUNNING by recompute."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence being generated. Fields from `num_computed_tokens` to `block_ids` are owned by the scheduler.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt (non-empty).
        sampling_params: decoding options (validated where they enter: LLM.generate, the server).
        eos_token_ids: token ids that count as EOS for this model.
        arrival_time: time.monotonic() at creation; FCFS order.
        priority: lower is served earlier (only with the scheduler's "priority" policy).
        cache_namespace: prefix-cache namespace (e.g. model or adapter name); requests in different namespaces
            never share KV blocks.
        output_token_ids: generated tokens, appended by `append_output`.
        output_logprobs: one entry per output token when logprobs were passed to the scheduler's update.
        num_computed_tokens: positions whose KV is written (see the module docstring).
        status: lifecycle state.
        finish_reason: 'stop' | 'length' | 'abort' | 'error' once finished.
        finish_message: human-readable detail for 'error' (and optional for others).
        num_cached_tokens: prompt tokens served from the prefix cache at the (last) admission.
        num_preemptions: times this request was preempted.
        block_ids: KV blocks covering positions [0, num_computed_tokens + scheduled); changed only by the
            scheduler's KVManager.
        spec_token_ids: draft tokens proposed to follow all_token_ids, set by the engine before `schedule` for
            speculative verification (empty: none). A decode row then computes its last token and the drafts in
            one step (the scheduler may trim them: ScheduledRequest.num_draft says how many); `update` accepts a
            prefix of them and clears the list. Only decode rows of running requests use them.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0
    cache_namespace: Any = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[Any] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    finish_message: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        # Kept in sync by append_output so that per-step slicing does not rebuild prompt + outputs.
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The live list: read it, do not mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stop_ids(self) -> set[int]:
        """Token ids that end generation (once min_tokens is reached): stop_token_ids, and EOS unless ignore_eos."""
        p = self.sampling_params
        return set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(self.eos_token_ids)

    def remaining_tokens(self, max_model_len: int) -> int:
        """Output tokens the request may still generate: up to max_tokens outputs and max_model_len tokens in all.
        The one budget every path checks (the scheduler's drafts, the device loops' per-row limits, stops)."""
        return min(self.sampling_params.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens)

    def first_stop(self, tokens: Sequence[int], max_model_len: int) -> tuple[int, FinishReason | None]:
        """(tokens to keep, the stop they end on or None) if `tokens` were appended one by one (Scheduler.update):
        token j (0-based) makes the output n0 + j + 1 long; it stops on a stop id or EOS once that is >=
        min_tokens, or on reaching max_tokens or max_model_len. One pass per row, not one check per token (the
        host's apply of a k-step loop is on the decode's critical path)."""
        params = self.sampling_params
        n0 = self.num_output_tokens
        last = self.remaining_tokens(max_model_len)  # a length stop keeps `last` tokens
        stops = self.stop_ids()
        if stops and not stops.isdisjoint(tokens):
            for j in range(max(params.min_tokens - n0 - 1, 0), min(max(last, 1), len(tokens))):
                if tokens[j] in stops:
                    return j + 1, "stop"
        if last <= len(tokens) and tokens:
            return max(last, 1), "length"
        return len(tokens), None

    def extend_output(self, token_ids: Sequence[int], logprobs: Sequence[Any] | None = None) -> None:
        """Appends generated tokens (and their logprob entries when given)."""
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if logprobs:
            self.output_logprobs.extend(logprobs)

    def append_output(self, token_id: int, logprob: Any = None) -> None:
        """Appends one generated token (and its logprob entry when given)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)


@dataclasses.dataclass
class RequestOutput:
    """What the engine streams per step for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated since the previous output.
        finished: whether the request is done.
        finish_reason: set when finished.
        text: the detokenised delta, filled by the engine (the scheduler never touches text).
        new_logprobs: logprob entries matching new_token_ids, when requested.
        finish_message: detail for finish_reason 'error'.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    text: str = ""
    new_logprobs: list[Any] | None = None
    finish_message: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One completion: text, generated token ids, why it ended, and per-token logprobs."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    finish_message: str | None = None  # why, for finish_reason 'error' (e.g. a constraint's dead end)
