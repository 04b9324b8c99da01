"""Structured output on SmolLM2 (CPU): JSON schemas, json_object, regex, grammars, choices; constrained and
unconstrained rows in one batch; constraints that cannot be satisfied; the on-device mask; the HTTP server with
the official `openai` client (response_format, guided_* fields, tool_choice required / named).

One LLM serves the module (and the live server at its end). Generation is greedy, so every constrained output is
the model's own most likely text inside the grammar, and a validation failure is a real defect, not noise.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from model.sampling import SamplingTensors, sample, unpack_bitmask
from serving.core.request import Constraint, SamplingParams

MAX_MODEL_LEN = 448
ENGINE_OPTIONS = dict(
    attention_backend="xla",
    max_num_seqs=8,
    max_num_batched_tokens=64,
    block_size=16,
    num_kv_blocks=96,
    decode_steps=4,
    compilation_cache_dir=os.path.join(os.path.expanduser("~"), ".cache", "pallas-serve", "xla-tests"),
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
    "required": ["colour", "bright"],
    "additionalProperties": False,
}
LIST = {
    "type": "array",
    "items": {"type": "integer", "minimum": 1, "maximum": 9},
    "minItems": 2,
    "maxItems": 4,
}
NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "north": {"type": "boolean"}},
            "required": ["lat", "north"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "location"],
    "additionalProperties": False,
}
SCHEMA_PROMPTS = [
    (PERSON, "Describe a person as JSON with a name and an age."),
    (COLOUR, "Pick a colour and say whether it is bright, as JSON."),
    (LIST, "Give a short list of small numbers as a JSON array."),
    (NESTED, "Describe Paris as JSON: its name and location."),
]
PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm():
    from serving.engine.llm import LLM

    return LLM(max_model_len=MAX_MODEL_LEN, **ENGINE_OPTIONS)


def _run(engine, requests) -> dict:
    """Submits (prompt ids, SamplingParams) pairs together and steps until all finish: rid -> finished track."""
    rids = [engine.add_request(ids, params) for ids, params in requests]
    while any(engine.running(rid) for rid in rids):
        engine.step()
    return {rid: engine.pop_finished(rid) for rid in rids}


def _greedy(max_tokens: int, constraint=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=constraint, **kw).validate()


# The sampler's mask (no model) -----------------------------------------------------------------------------


def _pack(allowed_bv: np.ndarray) -> np.ndarray:
    b, v = allowed_bv.shape
    padded = np.zeros((b, -(-v // 32) * 32), np.uint8)
    padded[:, :v] = allowed_bv
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


_sample = jax.jit(sample, static_argnames=("num_logprobs",))


@pytest.mark.parametrize("v", [37, 1000])
def test_sampler_mask_allows_only_set_bits(v):
    rng = np.random.default_rng(v)
    b = 6
    allowed = rng.random((b, v)) < 0.1
    allowed[:, rng.integers(0, v)] = True  # every row allows something
    allowed[0] = True  # an unconstrained row: all ones
    mask = _pack(allowed)
    assert bool((np.asarray(unpack_bitmask(jnp.asarray(mask), v)) == allowed).all())
    logits = jnp.asarray(rng.normal(size=(b, v)), jnp.float32)
    greedy = SamplingTensors.from_rows([{}] * b)
    tok, *_ = _sample(logits, greedy, allowed_bitmask_bw=jnp.asarray(mask))
    expect = np.where(allowed, np.asarray(logits), -np.inf).argmax(-1)
    assert np.asarray(tok).tolist() == expect.tolist()
    hot = SamplingTensors.from_rows([dict(temperature=1.5, top_p=0.9, seed=s, step=3) for s in range(b)])
    for step in range(8):
        hot.step = np.full(b, step, np.int32)
        tok, *_ = _sample(logits, hot, allowed_bitmask_bw=jnp.asarray(mask))
        assert all(allowed[i, t] for i, t in enumerate(np.asarray(tok).tolist()))
    # All ones is no mask at all: row 0's draw equals the unmasked sampler's.
    tok_masked, lp_masked, *_ = _sample(logits, hot, allowed_bitmask_bw=jnp.full_like(jnp.asarray(mask), -1))
    tok_plain, lp_plain, *_ = _sample(logits, hot)
    assert np.asarray(tok_masked).tolist() == np.asarray(tok_plain).tolist()
    np.testing.assert_array_equal(np.asarray(lp_masked), np.asarray(lp_plain))


def test_constraint_validation():
    assert Constraint.json_schema(PERSON).validate().kind == "json_schema"
    bad = [
        (Constraint("xml", "x"), "constraint.kind"),
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "object or a boolean"),
        (Constraint("regex", ""), "must not be empty"),
        (Constraint("json_object", "{}"), "must be empty"),
        (Constraint("choice", "[]"), "non-empty JSON list"),
    ]
    for c, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(constraint=c).validate()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(constraint=Constraint("json_object"), ignore_eos=True).validate()
    with pytest.raises(ValueError, match="constraint must be"):
        SamplingParams(constraint={"type": "json_object"}).validate()


# Engine on SmolLM2 -------------------------------------------------------------------------------------------


def test_json_schemas_validate(llm):
    engine = llm.engine
    reqs = [
        (llm.encode_prompt(p, chat=True), _greedy(64, Constraint.json_schema(schema))) for schema, p in SCHEMA_PROMPTS
    ]
    tracks = _run(engine, reqs)
    for (schema, _), track in zip(SCHEMA_PROMPTS, tracks.values()):
        assert track.request.finish_reason == "stop", (track.text, track.request.finish_message)
        jsonschema.validate(json.loads(track.text), schema)
    assert len(engine.structured) == 0  # every matcher released


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm):
    engine = llm.engine
    plain = [(llm.encode_prompt(p), _greedy(24)) for p in PLAIN_PROMPTS]
    loops_before = engine.num_decode_loops
    alone = [t.request.output_token_ids for t in _run(engine, plain).values()]
    assert engine.num_decode_loops > loops_before  # unconstrained-only batches keep their multi-step loops
    constrained = [
        (llm.encode_prompt(SCHEMA_PROMPTS[0][1], chat=True), _greedy(48, Constraint.json_schema(PERSON))),
        (llm.encode_prompt("A phone number:"), _greedy(16, Constraint("regex", r"\(\d{3}\) \d{3}-\d{4}"))),
    ]
    tracks = list(_run(engine, plain[:1] + constrained + plain[1:]).values())
    assert [tracks[0].request.output_token_ids, tracks[3].request.output_token_ids] == alone
    jsonschema.validate(json.loads(tracks[1].text), PERSON)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", tracks[2].text), tracks[2].text
    assert all(t.request.finish_reason in ("stop", "length") for t in tracks)


def test_constrained_row_takes_the_step_path(llm):
    from serving.core.request import Request

    loops = llm.engine.loops

    plain = Request("a", [1, 2, 3], _greedy(32))
    tied = Request("b", [1, 2, 3], _greedy(32, Constraint("json_object")))
    assert loops.row_limit(plain, 0) == llm.engine.config.decode_steps
    assert loops.row_limit(tied, 0) is None


def test_regex_and_json_object(llm):
    outs = llm.generate(
        ["The date of the moon landing, as YYYY-MM-DD:"],
        max_tokens=16,
        constraint=Constraint("regex", r"\d{4}-\d{2}-\d{2}"),
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outs[0].text) and outs[0].finish_reason == "stop"
    out = llm.generate(
        ['Reply with a JSON object like {"answer": 4}. What is 2+2?'],
        max_tokens=48,
        chat=True,
        constraint=Constraint("json_object"),
    )[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


def test_grammars_and_choice(llm):
    lark = 'start: answer "." \nanswer: "yes" | "no"'
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    prompts = ["Is the sky blue? Answer yes or no."] * 3
    constraints = [Constraint("grammar", lark), Constraint("grammar", gbnf), Constraint.choice(["red", "blue"])]
    tracks = _run(llm.engine, [(llm.encode_prompt(p, chat=True), _greedy(16, c)) for p, c in zip(prompts, constraints)])
    texts = [t.text for t in tracks.values()]
    assert texts[0] in ("yes.", "no.") and texts[1] in ("The answer is yes.", "The answer is no."), texts
    assert texts[2] in ("red", "blue")
    assert all(t.request.finish_reason == "stop" for t in tracks.values())


def test_unsatisfiable_and_invalid_constraints_are_refused(llm):
    cases = [
        (Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable schema"),
        (Constraint.json_schema({"type": "object", "required": ["a"], "additionalProperties": False}), "a"),
        (Constraint("regex", "(("), "unclosed group"),
        (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
    ]
    for c, detail in cases:
        with pytest.raises(ValueError, match=f"(?s)constraint {c.kind} does not compile.*{re.escape(detail)}"):
            llm.generate(["x"], max_tokens=4, constraint=c)
    # Found by the schemathesis fuzz: llguidance's first mask for astral-plane literals allows a token it then
    # refuses; the probe at compile time turns the mid-generation server error into a refusal.
    with pytest.raises(ValueError, match="cannot be enforced with this tokenizer"):
        llm.generate([";"], max_tokens=4, constraint=Constraint("regex", "\U0007e458\U000613ec"))
    assert not llm.engine.has_unfinished() and len(llm.engine.structured) == 0


def test_dead_end_finishes_with_an_error(llm):
    """The grammar is complete after 'yes'/'no' but min_tokens bans EOS until 6 tokens: no token may follow."""
    engine = llm.engine
    stuck = _greedy(12, Constraint.choice(["yes", "no"]), min_tokens=6)
    other = _greedy(8)
    tracks = list(
        _run(engine, [(llm.encode_prompt("Yes or no?"), stuck), (llm.encode_prompt("Hello"), other)]).values()
    )
    assert tracks[0].request.finish_reason == "error"
    assert "dead end" in tracks[0].request.finish_message and "min_tokens=6" in tracks[0].request.finish_message
    assert tracks[1].request.finish_reason == "length" and len(tracks[1].request.output_token_ids) == 8
    out = llm.generate(["Yes or no?"], max_tokens=12, min_tokens=6, constraint=Constraint.choice(["yes", "no"]))[0]
    assert out.finish_reason == "error" and "dead end" in out.finish_message


def test_bitmask_rows_and_dead_ends(llm):
    """Masks of a mixed batch (no model run): constrained rows follow their grammar, others and padding all ones;
    a row whose grammar allows only EOS while min_tokens bans it is a dead end; a refused token is an error."""
    from serving.core.request import Request

    so = llm.engine.structured
    tok = llm.tokenizer
    eos = llm.engine.eos_token_ids
    done = Request("done", [1], _greedy(8, Constraint.choice(["yes"]), min_tokens=4))
    fresh = Request("fresh", [1], _greedy(8, Constraint("regex", "[0-9]+")))
    plain = Request("plain", [1], _greedy(8))
    for r in (done, fresh):
        so.add(r.request_id, r.sampling_params.constraint)
    try:
        assert so.advance(done, tok.encode("yes")) is not None  # complete before min_tokens: not 'stop'
        banned = np.full((4, 8), -1, np.int32)
        banned[0, : len(eos)] = eos
        mask, dead = so.bitmask([done, fresh, plain], 4, banned)
        allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, : so.vocab_size].astype(bool)
        assert sorted(np.nonzero(allowed[0])[0].tolist()) == sorted(eos)  # the grammar allows only EOS now
        assert list(dead) == ["done"] and "dead end" in dead["done"]
        digits = [t for t in np.nonzero(allowed[1])[0].tolist()[:200] if t not in eos]
        assert digits and all(tok.decode([t]).isdigit() for t in digits)
        assert not any(allowed[1, t] for t in eos)  # nothing generated yet: the regex does not accept
        assert allowed[2].all() and allowed[3].all()
        letter = tok.encode("x")
        assert "refused" in so.advance(fresh, letter)
    finally:
        so.remove("done")
        so.remove("fresh")


# HTTP server with the official openai client ------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(llm):
    import openai

    from serving.api import app as srv
    from tests.live_app import serving_in_thread

    asgi = srv.create_app(lambda: llm, model_name=srv.DEFAULT_MODEL_NAME, warmup=False)
    with serving_in_thread(asgi, health_timeout_s=300) as (_, _, url):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_server_response_format(client):
    import openai

    from serving.api.app import DEFAULT_MODEL_NAME as model

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": SCHEMA_PROMPTS[0][1]}],
        response_format=fmt,
        max_tokens=48,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(
        model=model,
        prompt="A JSON object describing a cat:",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert r.choices[0].text.startswith("{")
    r = client.completions.create(
        model=model, prompt="Zip code:", max_tokens=8, temperature=0, extra_body={"guided_regex": r"\d{5}"}
    )
    assert re.fullmatch(r"\d{5}", r.choices[0].text)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Pick a colour."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"guided_choice": ["red", "green"]},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("red", "green")
    with pytest.raises(openai.BadRequestError, match="Unsatisfiable schema"):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 2, "maximum": 1}},
            },
            max_tokens=4,
        )
    with pytest.raises(openai.BadRequestError, match="at most one structured-output field"):
        client.completions.create(
            model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "a", "guided_choice": ["b"]}
        )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
        },
    },
}


def test_server_tool_choice_is_enforced(client):
    from serving.api.app import DEFAULT_MODEL_NAME as model

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, name in [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]:
        r = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64, temperature=0
        )
        calls = r.choices[0].message.tool_calls
        assert calls and len(calls) == 1, r.choices[0].message
        fn = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
        assert name is None or calls[0].function.name == name
        jsonschema.validate(json.loads(calls[0].function.arguments), fn["function"]["parameters"])
        assert r.choices[0].finish_reason in ("stop", "tool_calls")


def test_mask_is_applied_on_device():
    """The jitted masked sampler keeps the mask a device operand (no host round trip inside the sampler)."""
    from serving.engine.structured import sample_rows_masked

    v, s = 100, 2
    mask = _pack(np.eye(v, dtype=bool)[[3, 97]])
    logits = jnp.zeros((s, v), jnp.float32)
    banned = np.full((s, 8), -1, np.int32)
    st = SamplingTensors.from_rows([{}] * s)
    lowered = sample_rows_masked.lower(logits, st, None, None, banned, mask)
    assert "shift_right" in lowered.as_text()
    tok, *_ = sample_rows_masked(logits, st, None, None, banned, jax.device_put(mask))
    assert np.asarray(tok).tolist() == [3, 97]
