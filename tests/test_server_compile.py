"""The server over a real (tiny, random) engine on the CPU: a prompt at max_model_len served right after start-up
compiles nothing (every executable the limits can reach was compiled before /health said ready), and prompt
logprobs of a long prompt run beside a short request without stalling it.

With the XLA attention path (pallas_kernels/paged_attention_xla.py), whose work follows the keys attended, one block
table width serves every step, so the warm-up covers a prompt of any length.
"""

import statistics
import threading
import time

import httpx
import jax.numpy as jnp
import psutil
import pytest

from model.config import ModelConfig
from model.transformer import random_model
from serving.api import app as srv
from tests.fake_serving import FakeTokenizer
from tests.live_app import serving_in_thread

MODEL = "tiny"
MAX_MODEL_LEN = 512
ENGINE = dict(
    max_model_len=MAX_MODEL_LEN,
    block_size=8,
    max_num_seqs=2,  # few executables per width: one ragged step, two decode steps and loops
    max_num_batched_tokens=16,
    attention_backend="xla",
    decode_steps=1,
    warmup=True,
    compilation_cache_dir="",
)


class CharTokenizer(FakeTokenizer):
    """FakeTokenizer's encoding, with a distinct text per token id (top_logprobs are keyed by text)."""

    eos_token_ids = (2,)
    bos_token_id = None
    max_token_chars = 5

    def token_text(self, t: int) -> str:
        return f"<{int(t)}>"

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.token_text(t) for t in ids)


@pytest.fixture(scope="module")
def live():
    from serving.engine.llm import LLM

    cfg = ModelConfig.tiny(max_position_embeddings=MAX_MODEL_LEN, num_layers=1)
    llm = LLM.from_model(random_model(cfg, jnp.float32, seed=0), CharTokenizer(), **ENGINE)
    asgi = srv.create_app(lambda: llm, model_name=MODEL, warmup=True)
    with serving_in_thread(asgi, health_timeout_s=300) as (server, thread, url):
        yield llm, asgi.state.server, url


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0.0} | body, timeout=300)


def test_a_prompt_at_max_model_len_right_after_start_up_compiles_nothing(live):
    """(Short requests beside a long prefill: tests/test_scheduler.py, prefill_share_while_waiting.)"""
    llm, state, url = live
    runner = llm.engine.runner
    assert runner.width_buckets == (runner.max_blocks,)  # one table width: the warm-up covered every length
    assert all(runner.has_executable(key) for key, _, _ in runner.warmup_plan((llm.engine.config.decode_steps,)))
    compiles = runner.num_compiles
    long = _post(url, {"prompt": [(7 * i) % 500 + 3 for i in range(MAX_MODEL_LEN - 24)], "max_tokens": 8})
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["completion_tokens"] == 8
    assert runner.num_compiles == compiles  # no step executable made while serving
    assert _metric(url, "pallas_serve_engine_thread_compiles_total") == 0
    assert _metric(url, "pallas_serve_requests_waiting_for_compile") == 0


def _short_beside_echo(url: str, short: dict, echo_body: dict) -> tuple[float, list[float], dict]:
    """The short request's median idle latency, then its latencies while three echo requests run one after the other
    (the last echo's response and the echoes' times in the dict)."""
    idle = []
    for _ in range(5):
        t0 = time.monotonic()
        assert _post(url, short).status_code == 200
        idle.append(time.monotonic() - t0)
    echo = {"times": []}

    def echo_thrice():  # long enough beside the short requests for several of them to run meanwhile
        for _ in range(3):
            t0 = time.monotonic()
            echo["r"] = _post(url, echo_body)
            echo["times"].append(time.monotonic() - t0)
            assert echo["r"].status_code == 200, echo["r"].text

    t = threading.Thread(target=echo_thrice)
    t.start()
    time.sleep(0.2)
    beside = []
    while t.is_alive() and len(beside) < 7:
        t0 = time.monotonic()
        assert _post(url, short).status_code == 200
        beside.append(time.monotonic() - t0)
    t.join(timeout=300)
    return statistics.median(idle), beside, echo


def test_prompt_logprobs_of_a_long_prompt_do_not_stall_a_short_request(live):
    llm, state, url = live
    short = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    _post(url, short)
    prompt = [(11 * i) % 500 + 3 for i in range(MAX_MODEL_LEN - 8)]
    echo_body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 5}
    # First use of the scoring path and of the table widths the long prompt needs (compiled in the background:
    # what this test measures is the chunks' share of the engine thread, not a compile's share of the CPU).
    assert _post(url, echo_body).status_code == 200
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    # Shared, the short request takes ~1.3x its idle time (the scoring chunks may take half the engine thread's
    # time: 1.5x at most, plus a chunk's overshoot). Stalled, it waits for the rest of an echo: about an echo's
    # time (~180 ms against ~27 ms idle on a quiet 2-core host), and only 2 fit beside the three echoes. A
    # neighbour's load (CI runs two test workers on two cores) can slow the beside runs and not the idle ones, so a
    # measurement that misses is taken again, up to three times; a stall misses every time.
    for _attempt in range(3):
        idle_s, beside, echo = _short_beside_echo(url, short, echo_body)
        beside_s, echo_s = statistics.median(beside), statistics.median(echo["times"])
        print(
            f"short request: idle {idle_s * 1e3:.0f} ms, beside the echo {beside_s * 1e3:.0f} ms ({len(beside)} "
            f"runs); echo {echo_s * 1e3:.0f} ms"
        )
        shared = len(beside) >= 3 and beside_s < 2 * idle_s + 0.02
        if shared:
            break
    assert shared, (idle_s, beside)
    lp = echo["r"].json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) and all(len(top) == 5 for top in lp["top_logprobs"][1:])
    assert proc.memory_info().rss - rss0 < 200 << 20
    # the same logprobs as the model's own teacher-forced logits
    logits = llm.score(prompt)
    ref = jnp.take_along_axis(jnp.asarray(logits[:-1]), jnp.asarray(prompt[1:])[:, None], axis=-1)[:, 0]
    ref = ref - jnp.log(jnp.exp(jnp.asarray(logits[:-1])).sum(-1))
    got = jnp.asarray(lp["token_logprobs"][1:])
    assert float(jnp.abs(got - ref).max()) < 1e-3
    assert _metric(url, "pallas_serve_engine_thread_compiles_total") == 0
