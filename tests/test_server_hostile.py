"""The HTTP server against hostile and unusual clients, over a model-free engine (tests/fake_serving.py), so each
case takes milliseconds: body caps and timeouts, half-open sockets, auth before the body, strict validation,
drain deadlines, fresh /metrics, usage placement, RSS after large bodies, and the OpenAI surface (best_of, echo
with prompt logprobs, token-id prompts, tools). Every defect a hostile loopback test found
has a regression test here.
"""

import contextlib
import json
import signal
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from serving.api import app as srv
from serving.api import http as server_http
from tests.fake_serving import REJECT, FakeLLM
from tests.script_run import run_script

MODEL = "fake"
CAP = 4 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, llm, asgi, server, thread, url):
        self.llm, self.asgi, self.server, self.thread, self.url = llm, asgi, server, thread, url
        self.state = asgi.state.server

    def post(self, path, body=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=30, **kw)

    def raw(self, data: bytes, timeout: float = 5.0) -> bytes:
        """Sends raw bytes on a fresh connection; returns all the server sent until it closed or went quiet."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(data)
            s.settimeout(timeout)
            out = b""
            with contextlib.suppress(TimeoutError):
                while chunk := s.recv(65536):
                    out += chunk
            return out

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def serve(llm=None, *, drain_timeout_s=None, header_timeout_s=1.0, **app_kw):
    llm = llm or FakeLLM()
    app_kw = dict(max_body_bytes=CAP, body_timeout_s=1.0) | app_kw
    asgi = srv.create_app(lambda: llm, model_name=MODEL, warmup=False, **app_kw)
    port = _free_port()
    config = uvicorn.Config(
        asgi,
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="on",
        http=server_http.timed_h11_protocol(header_timeout_s),
        timeout_graceful_shutdown=(drain_timeout_s or 30) + 5,
    )
    server = srv.DrainingServer(config, drain_timeout_s=drain_timeout_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "fake server did not become healthy"
        time.sleep(0.05)
    try:
        yield Server(llm, asgi, server, thread, url)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def live():
    with serve() as s:
        yield s


def _completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 3} | kw


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3} | kw


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    return r.json()["error"]


# Body size, counting before encoding, tokenising off the loop -------------------------------------------------


def test_body_over_the_cap_is_refused_before_it_is_read(live):
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {CAP + 1}"
    t0 = time.monotonic()
    reply = live.raw(head.encode() + b"\r\n\r\n{", timeout=3)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"max_body_bytes" in reply and time.monotonic() - t0 < 2
    chunked = httpx.post(  # no Content-Length: the running total is what trips
        live.url + "/v1/completions", content=iter([b'{"prompt": "' + b"a" * CAP, b'"}']), timeout=30
    )
    assert "at most" in _error(chunked, 413)["message"]


def test_prompts_times_n_are_counted_before_encoding(live):
    calls = live.llm.tokenizer.encode_calls
    r = live.post("/v1/completions", _completion(prompt=[[1, 2]] * 100_000))
    assert "100000 sequences" in _error(r, 400)["message"]
    r = live.post("/v1/completions", _completion(prompt=["ab"] * 200, n=2))
    assert "400 sequences" in _error(r, 400)["message"]
    assert live.llm.tokenizer.encode_calls == calls  # nothing was encoded


def test_text_too_long_for_any_tokenisation_is_refused_unencoded(live):
    calls = live.llm.tokenizer.encode_calls
    r = live.post("/v1/completions", _completion(prompt="x" * 300))  # > 256 tokens of at most 1 character
    assert "300 characters" in _error(r, 400)["message"]
    r = live.post("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "y" * 300}]))
    assert _error(r, 400)["code"] == "context_length_exceeded"
    assert live.llm.tokenizer.encode_calls == calls


def test_tokenising_runs_off_the_event_loop(live):
    live.llm.tokenizer.encode_delay_s = 2.0
    try:
        t = threading.Thread(target=live.post, args=("/v1/completions", _completion()))
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.get(live.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 0.5
        t.join()
    finally:
        live.llm.tokenizer.encode_delay_s = 0.0


def test_large_bodies_are_followed_by_a_heap_trim(live, monkeypatch):
    """After a large body the server schedules gc + malloc_trim (serving/api/http.py); small ones do not."""
    calls = []
    monkeypatch.setattr(server_http, "trim_heap", lambda: calls.append(1))
    live.post("/v1/completions", _completion())
    time.sleep(0.5)
    assert not calls
    body = json.dumps(_completion(prompt="x" * (2 << 20))).encode()
    r = httpx.post(live.url + "/v1/completions", content=body, timeout=60)
    assert _error(r, 400)["code"] == "context_length_exceeded"
    time.sleep(0.5)
    assert calls == [1]


TRIM_SCRIPT = r"""
import json, os
import psutil
from serving.api import http as server_http

proc = psutil.Process(os.getpid())
server_http.trim_heap()
base = proc.memory_info().rss
blocks = [bytearray(1000) for _ in range(200_000)]  # ~200 MB of small heap blocks
keep = blocks[::500]  # a few survivors pin the top of the heap
del blocks
held = proc.memory_info().rss
trimmed_ok = server_http.trim_heap()
print("ok", json.dumps(dict(base=base, held=held, trimmed=proc.memory_info().rss, trimmed_ok=trimmed_ok)))
"""


def test_trim_heap_returns_freed_memory():
    """Many small blocks freed out of order stay in glibc's arenas until malloc_trim hands them back (server-level
    figures: tools/server_probe.py, BENCHMARKS.md). In a fresh process: a worker's heap, holed by earlier tests,
    would take some of the blocks from its free lists and grow by less."""
    m = run_script(TRIM_SCRIPT, timeout=300)
    mib = {k: round(v / 2**20) for k, v in m.items() if k != "trimmed_ok"}
    assert m["trimmed_ok"], mib
    assert m["held"] - m["base"] > 100 << 20 and m["trimmed"] - m["base"] < (m["held"] - m["base"]) / 2, mib


# Timeouts and half-open sockets -------------------------------------------------------------------------------


def test_half_open_and_slow_header_sockets_are_closed(live):
    socks = []
    for i in range(50):
        s = socket.create_connection(("127.0.0.1", live.port))
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        socks.append(s)
    time.sleep(1.6)
    for s in socks:
        s.settimeout(2)
        try:
            assert s.recv(1) == b""  # closed by the server
        except ConnectionResetError:
            pass
        s.close()


def test_body_read_timeout_gets_408(live):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    reply = live.raw(head + b'{"model":', timeout=4)
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply, reply[:300]


def test_malformed_http_gets_openai_json(live):
    reply = live.raw(b"GARBAGE\x01 / HTTP/9\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "bad_http_request"


# Auth, docs, metrics -----------------------------------------------------------------------------------------


def test_api_key_is_checked_before_the_body_and_docs_are_off():
    with serve(api_key="k3y", protect_metrics=True) as s:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(head)
            sock.settimeout(0.8)
            reply = sock.recv(65536)  # the body never comes: the 401 must not wait for it
        assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(s.url + path).status_code == 404
        assert _error(httpx.get(s.url + "/metrics"), 401)["code"] == "invalid_api_key"
        ok = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200 and "pallas_serve_queue_length" in ok.text
    with serve(enable_docs=True) as s:
        assert "CompletionRequest" in httpx.get(s.url + "/openapi.json").json()["components"]["schemas"]


def test_metrics_gauges_are_fresh_during_a_long_step():
    with serve() as s:
        s.llm.engine.gate.clear()  # the engine thread blocks inside its next step
        threads = [
            threading.Thread(target=s.post, args=("/v1/completions", _completion(max_tokens=2))) for _ in range(6)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while True:
            m = httpx.get(s.url + "/metrics").text
            queued = [line for line in m.splitlines() if line.startswith("pallas_serve_queue_length ")]
            if float(queued[0].split()[1]) >= 5:  # one may be in the blocked step already
                break
            assert time.monotonic() < deadline, queued
            time.sleep(0.05)
        s.llm.engine.gate.set()
        for t in threads:
            t.join()


# Validation --------------------------------------------------------------------------------------------------

BAD = [
    ("stream yes", "/v1/completions", _completion(stream="yes"), "stream"),
    (
        "stream_options without stream",
        "/v1/completions",
        _completion(stream_options={"include_usage": True}),
        "stream_options is only allowed",
    ),
    (
        "user content null",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": None}]),
        "content must not be null",
    ),
    ("float token ids", "/v1/completions", _completion(prompt=[1.5, 2.0]), "list of token ids (integers)"),
    (
        "tool without id",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]),
        "tool_call_id",
    ),
    ("logit_bias key", "/v1/completions", _completion(logit_bias={"five": 3.0}), "logit_bias"),
    ("logit_bias value", "/v1/completions", _completion(logit_bias={"5": 300.0}), "logit_bias"),
    ("unknown field", "/v1/completions", _completion(frobnicate=1), "frobnicate"),
    (
        "tool_choice names no tool",
        "/v1/chat/completions",
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        "not in tools",
    ),
    ("best_of < n", "/v1/completions", _completion(n=3, best_of=2), "best_of"),
    ("max_tokens 0 no echo", "/v1/completions", _completion(max_tokens=0), "needs echo"),
    ("messages and ids", "/v1/chat/completions", _chat(prompt_token_ids=[1, 2]), "not both"),
]


@pytest.mark.parametrize("name,path,body,needle", BAD, ids=[b[0] for b in BAD])
def test_strict_validation(live, name, path, body, needle):
    assert needle in _error(live.post(path, body), 400)["message"]


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b'{"model": "fake", "prompt": "\xff\xfe"}', "not valid UTF-8: byte 0xff at position 29"),
        (b"[" * 100 + b"]" * 100, "nests deeper than 64"),
        (b"[" * 100_000, "nests deeper than 64"),
        (b'{"model": ', "invalid JSON body"),
    ],
)
def test_body_parse_errors_are_specific(live, raw, needle):
    r = httpx.post(live.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert needle in _error(r, 400)["message"]


def test_default_max_tokens_is_clamped_to_the_pool_and_ids_stay_internal(live):
    """The fake pool holds 12 x 16 = 192 positions per request, less than max_model_len 256."""
    assert live.post("/v1/chat/completions", _chat(max_tokens=None)).status_code == 200
    ids, params = live.llm.engine.added[-1]
    assert params.max_tokens == 192 - len(ids)
    msg = _error(live.post("/v1/completions", _completion(prompt=[REJECT, 1])), 400)["message"]
    assert "cmpl-" not in msg and "rejected" not in msg and "KV blocks" in msg


# Streams: usage, drain ---------------------------------------------------------------------------------------


def _events(url, body) -> list:
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_usage_only_when_include_usage(live):
    for path, body in (("/v1/completions", _completion(stream=True)), ("/v1/chat/completions", _chat(stream=True))):
        chunks = _events(live.url + path, body)
        assert all("usage" not in c for c in chunks)
        body["stream_options"] = {"include_usage": True}
        chunks = _events(live.url + path, body)
        assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_drain_deadline_ends_requests_with_shutting_down_errors():
    with serve(drain_timeout_s=0.5) as s:
        s.llm.engine.step_s = 0.05
        got = {}

        def stream():
            got["stream"] = _events(s.url + "/v1/completions", _completion(max_tokens=10_000 // 100, stream=True))

        def plain():
            got["plain"] = s.post("/v1/chat/completions", _chat(max_tokens=100))

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        while len(s.llm.engine.scheduler.running) < 2:
            time.sleep(0.02)
        s.server.handle_exit(signal.SIGTERM, None)
        for t in threads:
            t.join(timeout=20)
        assert got["stream"][-1]["error"]["code"] == "server_shutting_down"
        assert _error(got["plain"], 503)["code"] == "server_shutting_down"
        s.thread.join(timeout=20)
        assert not s.thread.is_alive()


# The rest of the OpenAI surface ------------------------------------------------------------------------------


def test_best_of_returns_the_highest_cumulative_logprob(live):
    """Seed s emits tokens s, s+1, ... with logprob -t/10: the candidate with seed 10 (+0) ranks first."""
    r = live.post("/v1/completions", _completion(n=1, best_of=3, seed=10)).json()
    assert [c["text"] for c in r["choices"]] == ["klm"] and r["choices"][0]["logprobs"] is None
    assert r["usage"]["completion_tokens"] == 9
    r = live.post("/v1/completions", _completion(n=2, best_of=3, seed=10, logprobs=1)).json()
    assert [c["text"] for c in r["choices"]] == ["klm", "lmn"] and [c["index"] for c in r["choices"]] == [0, 1]


def test_echo_with_prompt_logprobs(live):
    r = live.post("/v1/completions", _completion(prompt=[0, 1, 5], max_tokens=0, echo=True, logprobs=2)).json()
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == "abf" and lp["tokens"] == ["a", "b", "f"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1] > lp["token_logprobs"][2]  # 'b' is the favoured token after position 0
    assert list(lp["top_logprobs"][1])[0] == "b" and lp["text_offset"] == [0, 1, 2]
    assert live.llm.engine.runner.rows[-1] == (0, 2)  # positions 0 and 1 predict the two later tokens
    r = live.post("/v1/completions", _completion(prompt=[0, 1], max_tokens=2, echo=True, logprobs=0)).json()
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == "abab" and len(lp["tokens"]) == 4 and lp["text_offset"] == [0, 1, 2, 3]


def test_token_id_prompts(live):
    r = live.post("/v1/chat/completions", {"model": MODEL, "prompt_token_ids": [3, 4, 5], "max_tokens": 2}).json()
    assert r["usage"]["prompt_tokens"] == 3 and live.llm.engine.added[-1][0] == [3, 4, 5]
    r = live.post("/v1/completions", _completion(prompt=[[1, 2], [3, 4, 5]], n=2)).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and r["usage"]["prompt_tokens"] == 5


def test_tool_calls_are_parsed(live):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = _chat(messages=[{"role": "user", "content": "CALLTOOL please"}], tools=tools, max_tokens=50)
    r = live.post("/v1/chat/completions", body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    chunks = _events(live.url + "/v1/chat/completions", body | {"stream": True})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    assert live.post("/v1/chat/completions", _chat(messages=history, tools=tools)).status_code == 200
