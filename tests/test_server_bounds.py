"""No request may stall the others, over the model-free engine (tests/fake_serving.py): request bodies never get a
500 (numeric edge cases fuzzed through the protocol layer), prompt logprobs run a chunk per engine turn beside
other requests and stop when their client leaves, /health fails while the engine loop is stalled, slow or
ambiguous bodies are refused, and shutdown keeps its bound with prompt-logprob work in flight.
"""

import json
import math
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.api import http as server_http
from serving.api.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from tests.fake_serving import VOCAB
from tests.test_server_hostile import MODEL, _completion, _error, serve


@pytest.fixture(scope="module")
def live():
    with serve(stall_timeout_s=0.5) as s:
        yield s


# Numbers: a 400 naming the field, never a 500 ----------------------------------------------------------------


def test_over_long_integer_is_a_400_naming_the_field(live):
    raw = b'{"model": "fake", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    err = _error(httpx.post(live.url + "/v1/completions", content=raw), 400)
    assert err["param"] == "max_tokens" and "5000 digits" in err["message"]
    raw = b'{"model": "fake", "prompt": [1, 2, -' + b"1" * 4400 + b"]}"
    assert _error(httpx.post(live.url + "/v1/completions", content=raw), 400)["param"] == "prompt"


@pytest.mark.parametrize("key", ["\u00b2", "\u00b9", "\u0663", "1" * 5000, " 7 x", "-1", "1e3"])
def test_logit_bias_keys_that_are_not_ascii_token_ids_are_a_400(live, key):
    err = _error(live.post("/v1/completions", _completion(logit_bias={key: 1.0})), 400)
    assert err["param"] == "logit_bias" and "token ids" in err["message"]


_EDGE_NUMBERS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**4299, -(10**4299)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["\u00b2", "\u0663", "NaN", "1" * 50, "", " 5"]),
)
_NUMERIC_FIELDS = [
    "n",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "max_tokens",
    "logprobs",
    "best_of",
]


def _encode(value) -> str:
    """JSON text for a value; NaN and infinities as Python's json writes them (NaN, Infinity), as a client may."""
    return json.dumps(value, allow_nan=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(_NUMERIC_FIELDS),
    value=_EDGE_NUMBERS,
    bias_key=st.one_of(st.none(), st.text(max_size=6), _EDGE_NUMBERS.map(str)),
    bias_value=_EDGE_NUMBERS,
    chat=st.booleans(),
)
def test_numeric_edge_cases_never_escape_the_protocol_layer(field, value, bias_key, bias_value, chat):
    """Huge, negative, NaN, infinite and unicode-digit values in every numeric field and in logit_bias: parsing,
    validation and the SamplingParams conversion raise only OpenAIError with a 4xx status."""
    model = ChatCompletionRequest if chat else CompletionRequest
    body = {"model": MODEL, "max_tokens": 4}
    body |= {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x", "logprobs": 1}
    if chat and field in ("logprobs", "best_of"):
        field = "top_logprobs"
    text = json.dumps(body)[:-1] + f', "{field}": {_encode(value)}'
    if bias_key is not None:
        text += f', "logit_bias": {{{json.dumps(bias_key)}: {_encode(bias_value)}}}'
    raw = (text + "}").encode()
    try:
        req = server_http.parse_model(raw, model)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        logprobs = (req.top_logprobs or 0) if chat else req.logprobs
        params = req.sampling_params(max_tokens, logprobs, VOCAB)
    except OpenAIError as e:
        assert 400 <= e.status < 500, e.message
        json.dumps(e.body())  # the error body itself serialises
        return
    assert all(math.isfinite(x) for x in (params.temperature, params.top_p, params.min_p))


def test_numeric_edge_cases_through_http_get_no_5xx(live):
    bodies = [
        _completion(max_tokens=10**4000),
        _completion(n=10**30),
        _completion(seed=2**64),
        _completion(top_k=10**300),
        _completion(temperature=10**400),
        _completion(min_tokens=10**20),
        _completion(stop_token_ids=[10**40]),
        _completion(prompt=[10**50]),
        _completion(logit_bias={"1": 10**400}),
    ]
    for body in bodies:
        r = live.post("/v1/completions", body)
        assert r.status_code < 500, (body, r.text)
    r = httpx.post(live.url + "/v1/completions", content=b'{"model": "fake", "prompt": "x", "temperature": NaN}')
    assert r.status_code == 400


# Framing, content type and slow bodies -----------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused_and_closed(live):
    body = b'{"model": "fake", "prompt": "hi", "max_tokens": 1}'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    pipelined = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = live.raw(head + chunked + pipelined, timeout=3)
    assert reply.startswith(b"HTTP/1.1 400") and b"ambiguous_framing" in reply, reply[:300]
    assert reply.count(b"HTTP/1.1 ") == 1  # the pipelined request is not served on that connection


def test_non_json_content_type_gets_415_and_a_missing_one_is_accepted(live):
    body = json.dumps(_completion(max_tokens=1)).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": ctype})
        assert _error(r, 415)["code"] == "unsupported_media_type"
    for headers in ({}, {"content-type": "application/json; charset=utf-8"}):
        assert httpx.post(live.url + "/v1/completions", content=body, headers=headers).status_code == 200


def test_a_trickled_body_hits_the_overall_deadline():
    """Each byte arrives well within the per-read timeout (6 s), the whole body does not within 3 s.

    The per-read timeout is longer than the deadline so that a host too loaded to deliver a byte for a while
    still meets the deadline first."""
    with serve(body_timeout_s=6.0, body_deadline_s=3.0) as s:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(head)
            sock.settimeout(0.05)
            t0, reply = time.monotonic(), b""
            while not reply and time.monotonic() - t0 < 10:
                try:
                    sock.sendall(b" ")
                    reply = sock.recv(65536)
                except TimeoutError:
                    time.sleep(0.1)
                except (BrokenPipeError, ConnectionResetError):
                    break
            elapsed = time.monotonic() - t0
        assert reply.startswith(b"HTTP/1.1 408") and b"body_deadline_s" in reply, reply[:300]
        assert 2.8 < elapsed < 6.0, elapsed


# Health and liveness -------------------------------------------------------------------------------------------


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_health_fails_while_the_engine_loop_is_stalled_and_metrics_show_the_step_age(live):
    assert httpx.get(live.url + "/health").status_code == 200
    assert live.post("/v1/completions", _completion(max_tokens=1)).status_code == 200
    assert 0 <= _metric(live.url, "pallas_serve_engine_last_step_age_seconds") < 5
    live.llm.engine.gate.clear()  # the next step blocks
    t = threading.Thread(target=live.post, args=("/v1/completions", _completion(max_tokens=2)))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while (r := httpx.get(live.url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200 with a stalled engine"
            time.sleep(0.1)
        assert r.status_code == 503 and "stalled" in r.json()["status"]
        assert _metric(live.url, "pallas_serve_engine_stalled_seconds") > 0.5
        assert _metric(live.url, "pallas_serve_engine_last_step_age_seconds") > 0.5
    finally:
        live.llm.engine.gate.set()
        t.join(timeout=10)
    deadline = time.monotonic() + 5
    while httpx.get(live.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "health did not recover"
        time.sleep(0.05)
    assert _metric(live.url, "pallas_serve_engine_thread_compiles_total") == 0
    time.sleep(0.8)  # idle is not stalled
    assert httpx.get(live.url + "/health").status_code == 200


# Prompt logprobs: chunked, beside other requests, cancelled with their client -------------------------------


def test_prompt_logprobs_run_in_chunks_beside_other_requests(live):
    runner = live.llm.engine.runner
    runner.chunk_s = 0.02
    try:
        prompt = list(range(26)) * 6  # 156 tokens: 10 chunks of at most 16 positions
        echo = {}
        t = threading.Thread(
            target=lambda: echo.update(
                r=live.post("/v1/completions", _completion(prompt=prompt, max_tokens=0, echo=True, logprobs=1))
            )
        )
        t.start()
        while not runner.rows or runner.rows[-1][0] == 0:
            time.sleep(0.005)
        t0 = time.monotonic()
        assert live.post("/v1/completions", _completion(max_tokens=2)).status_code == 200
        short = time.monotonic() - t0
        t.join(timeout=30)
        lp = echo["r"].json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 156 and lp["token_logprobs"][0] is None
        assert all(list(top)[0] == tok for top, tok in zip(lp["top_logprobs"][1:], lp["tokens"][1:]))
        chunks = [r for r in runner.rows if r[0] + r[1] <= 155][-10:]
        assert [start for start, _ in chunks] == list(range(0, 155, 16)) and max(n for _, n in chunks) == 16
        assert short < 0.15 * 10  # well under the echo's 10 chunks
        assert not live.llm.engine.scheduler.kv.held  # its blocks were given back
    finally:
        runner.chunk_s = 0.0


def test_disconnect_cancels_prompt_logprobs(live):
    runner = live.llm.engine.runner
    runner.chunk_s = 0.05
    try:
        before = len(runner.rows)
        body = _completion(prompt=list(range(26)) * 9, max_tokens=0, echo=True, logprobs=2)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.2)
        time.sleep(0.3)
        n = len(runner.rows)
        time.sleep(0.3)
        assert len(runner.rows) == n and n - before < 15  # stopped well before its 15 chunks
        assert not live.llm.engine.scheduler.kv.held
    finally:
        runner.chunk_s = 0.0


def test_shutdown_keeps_its_bound_with_prompt_logprobs_in_flight():
    with serve(drain_timeout_s=0.5) as s:
        s.llm.engine.runner.chunk_s = 0.2  # 15 chunks: 3 s of work
        got = {}
        body = _completion(prompt=list(range(26)) * 9, max_tokens=0, echo=True, logprobs=2)
        t = threading.Thread(target=lambda: got.update(r=s.post("/v1/completions", body)))
        t.start()
        while not s.llm.engine.runner.rows:
            time.sleep(0.01)
        t0 = time.monotonic()
        s.server.handle_exit(15, None)
        s.thread.join(timeout=20)
        t.join(timeout=5)
        assert not s.thread.is_alive() and time.monotonic() - t0 < 0.5 + 2.0
        assert _error(got["r"], 503)["code"] == "server_shutting_down"
        assert not s.llm.engine.scheduler.kv.held
