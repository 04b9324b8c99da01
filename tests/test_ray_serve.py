"""The Ray Serve deployment (serving/deploy) on a local Ray cluster: 2 replicas of the default SmolLM2.

One cluster and one application per module (Ray start, two engine loads and their compiles are the cost). The
routing policy's own tests need no Ray. The failover test kills a replica, so it runs last; the autoscaling
test starts extra replicas and runs only with PALLAS_SERVE_SLOW_TESTS=1.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from serving.deploy.prefix_index import AffinityPolicy, PrefixIndex, ReplicaLoad, block_names, rank_replicas

ray = pytest.importorskip("ray")

HEADER = "x-pallas-replica"
CACHE_DIR = os.environ.get(
    "PALLAS_SERVE_TEST_XLA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pallas-serve", "xla-tests")
)
ENGINE = dict(
    max_model_len=320,
    num_kv_blocks=48,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    attention_backend="xla",
    decode_steps=1,
    warmup=False,  # buckets compile on first use: fewer than a full warm-up on 2 cores
    compilation_cache_dir=CACHE_DIR,
)
SYSTEM = (
    "You are a concise assistant for a travel agency. Answer in one short sentence, name the country when you "
    "mention a city, and never invent prices, dates or opening hours that the customer did not give you."
)


# The policy, without Ray ---------------------------------------------------------------------------------------


def test_policy_prefers_longest_match_then_least_loaded():
    policy = AffinityPolicy(block_size=4, max_queue_gap=2, min_match_blocks=1)
    index = PrefixIndex(capacity_blocks=100)
    a, b = list(range(16)), list(range(8)) + [99] * 8
    index.insert("r1", block_names(a, 4))
    index.insert("r2", block_names(b, 4))
    assert index.match(block_names(a + [5], 4), ["r1", "r2"]) == {"r1": 4, "r2": 2}
    even = {"r1": ReplicaLoad(1), "r2": ReplicaLoad(0)}
    assert rank_replicas(index.match(block_names(a, 4), even), even, policy) == (["r1", "r2"], "affinity")
    skewed = {"r1": ReplicaLoad(3), "r2": ReplicaLoad(0)}  # gap 3 > 2
    assert rank_replicas(index.match(block_names(a, 4), skewed), skewed, policy) == (["r2", "r1"], "imbalanced")
    full = {"r1": ReplicaLoad(0, kv_usage=0.99), "r2": ReplicaLoad(1)}
    assert rank_replicas({"r1": 4}, full, policy)[1] == "imbalanced"
    assert rank_replicas({}, even, policy) == (["r2", "r1"], "no_match")


def test_index_evicts_least_recent_blocks_and_forgets_replicas():
    index = PrefixIndex(capacity_blocks=3)
    index.insert("r", block_names(list(range(8)), 2))  # 4 blocks: the first is evicted
    assert index.num_blocks("r") == 3
    assert index.match(block_names(list(range(8)), 2), ["r"]) == {"r": 0}  # a match starts at block 0
    index.remove("r")
    assert index.replicas == [] and block_names([1, 2, 3], 2) == block_names([1, 2], 2)
    with pytest.raises(ValueError, match="max_queue_gap"):
        AffinityPolicy(max_queue_gap=-1)


def test_autoscaling_policy_follows_queues_and_kv_usage():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from serving.deploy.autoscale import QueueAndKVPolicy

    dep = DeploymentID(name="engine", app_name="app")
    replicas = [ReplicaID("r1", dep), ReplicaID("r2", dep)]
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=8, upscale_delay_s=0)

    def wanted(kv_usage, requests):
        ctx = AutoscalingContext(
            deployment_id=dep,
            deployment_name="engine",
            app_name="app",
            current_num_replicas=2,
            target_num_replicas=2,
            running_replicas=replicas,
            total_num_requests=requests,
            total_queued_requests=0,
            aggregated_metrics={"kv_usage": dict(zip(replicas, kv_usage))},
            raw_metrics=None,
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=4,
            policy_state={},
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=time.time(),
            config=config,
        )
        return QueueAndKVPolicy(kv_usage_target=0.85)(ctx)[0]

    assert wanted([0.1, 0.1], 16) == 2  # 16 ongoing / 8 per replica
    assert wanted([0.95, 0.99], 2) == 3  # short queues, full pools: ceil(2 x 0.97 / 0.85)
    assert wanted([0.1, 0.1], 64) == 4  # capped at max_replicas


def test_deployment_options_and_flags():
    from serving.deploy.config import DeployConfig
    from serving.deploy.ray_app import engine_options

    fixed = engine_options(DeployConfig(replicas=2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["request_router_config"].request_router_kwargs["block_size"] == 16
    scaled = engine_options(
        DeployConfig(replicas=1, max_replicas=3, router="pow2", hosts_per_replica=2, replica_gpus=8)
    )
    assert scaled["autoscaling_config"]["max_replicas"] == 3 and "request_router_config" not in scaled
    assert scaled["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 8.0}] * 2
    with pytest.raises(ValueError, match="min 3 <= replicas 2"):
        DeployConfig(replicas=2, min_replicas=3)
    code = (
        "from serving.deploy.serve_cli import app_builder; "
        "print(type(app_builder({'flags': '--max_model_len 512 --ray_replicas 2 --ray_router pow2'})).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("Application"), out.stderr[-2000:]
    bad = subprocess.run(
        [sys.executable, "-m", "serving.server", "--ray_replicas", "2", "--ray_max_replicas", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "replicas 2 <= max 1" in bad.stderr


# The application ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from serving.config import EngineConfig, ServerConfig
    from serving.deploy import ray_app
    from serving.deploy.config import DeployConfig
    from tests.live_app import free_port

    engine = EngineConfig.from_kwargs(**ENGINE)
    server = ServerConfig(host="127.0.0.1", port=free_port())
    deploy = DeployConfig(
        replicas=2,
        replica_cpus=0.5,
        affinity=AffinityPolicy(block_size=engine.block_size, max_queue_gap=1),
        health_check_period_s=2.0,
        drain_timeout_s=10.0,
    )
    # The host is shared: Ray's own OOM killer (95% of the machine's memory, others' processes included) would kill
    # the controller or a replica mid-test; the kernel's OOM killer still guards the machine.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(
        num_cpus=4,
        object_store_memory=128 << 20,
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,
    )
    try:
        ray_app.start(engine, server, deploy)
        url = f"http://127.0.0.1:{server.port}"
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        yield url, model
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(url, model, messages, max_tokens=8, **extra):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0} | extra
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


def _metric(text: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(rf'^{name}{{replica="([^"]+)"}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_conversation_stays_on_its_replica(cluster):
    url, model = cluster
    messages = [{"role": "system", "content": SYSTEM}]
    replicas = []
    for question in ("Where is Kyoto?", "And Porto?", "Which of the two is further north?"):
        messages.append({"role": "user", "content": question})
        r = _chat(url, model, messages)
        assert r.status_code == 200, r.text
        replicas.append(r.headers[HEADER])
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    assert len(set(replicas)) == 1, replicas
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert _metric(metrics, "pallas_serve_replica_prefix_hit_tokens_total").get(replicas[0], 0) > 0
    assert _metric(metrics, "pallas_serve_replica_requests_total").get(replicas[0], 0) >= 3
    assert 0.0 <= _metric(metrics, "pallas_serve_replica_kv_usage")[replicas[0]] <= 1.0


def test_skewed_load_spreads_over_both_replicas(cluster):
    """Eight concurrent requests share one long prefix (all prefer the same replica); past the queue gap the
    router sends the rest to the other replica."""
    url, model = cluster
    messages = lambda i: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _chat(url, model, messages(i), max_tokens=16), range(8)))
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    served = [r.headers[HEADER] for r in results]
    assert len(set(served)) == 2, served


def test_streaming_through_the_ingress_matches_the_gathered_response(cluster):
    url, model = cluster
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = _chat(url, model, messages, max_tokens=10)
    assert whole.status_code == 200 and whole.headers[HEADER]
    body = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers[HEADER]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"]
    bad = _chat(url, model, messages, max_tokens=-1)  # serving/api's validation, through the ingress
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_openai_client_against_the_ray_endpoint(cluster):
    url, model = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0
    )
    assert raw.headers[HEADER]
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len(pieces) >= 1 and "".join(pieces)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def _one(url, model, i, stream):
    """(status, outcome): outcome "complete" (a finish reason), "error_event" (a stream's OpenAI error event
    then [DONE]) or "error_body" (a non-streaming OpenAI error)."""
    body = {"model": model, "prompt": f"Count slowly to ten, number {i}:", "max_tokens": 24, "temperature": 0.0}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        if r.status_code == 200:
            return 200, "complete" if r.json()["choices"][0]["finish_reason"] else "truncated"
        return r.status_code, "error_body" if "error" in r.json() else "unexplained"
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=300) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return r.status_code, "unterminated"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    if "error" in last:
        return r.status_code, "error_event"
    reasons = [c["choices"][0].get("finish_reason") for c in map(json.loads, events[:-1]) if c.get("choices")]
    return r.status_code, "complete" if any(reasons) else "truncated"


def test_failover_loses_no_request_and_replaces_the_replica(cluster):
    from ray import serve

    from serving.deploy.ray_app import APP_NAME

    url, model = cluster
    victim = _chat(url, model, [{"role": "user", "content": "hello"}], max_tokens=1).headers[HEADER]
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        before = [pool.submit(_one, url, model, i, i % 2 == 0) for i in range(6)]
        time.sleep(1.0)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#engine#{victim}", namespace="serve"), no_restart=True)
        after = [pool.submit(_one, url, model, 10 + i, i % 2 == 0) for i in range(4)]
        outcomes = [f.result() for f in before + after]
    assert all(o in ("complete", "error_event") for _, o in outcomes), outcomes
    assert all(o == "complete" for _, o in outcomes[6:]), outcomes  # sent after the kill: retried elsewhere
    # A whole-response request (odd i) showed nothing before its end, so it is restarted elsewhere, never failed.
    assert all(o == "complete" for i, (_, o) in enumerate(outcomes) if i % 2), outcomes
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        engine = serve.status().applications[APP_NAME].deployments["engine"]
        if engine.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(2)
    assert engine.replica_states.get("RUNNING", 0) == 2, engine
    r = _chat(url, model, [{"role": "user", "content": "hello again"}], max_tokens=2)
    assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PALLAS_SERVE_SLOW_TESTS"), reason="starts and stops replicas: ~2 minutes")
def test_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle(cluster):
    """Redeploys the module's application with 1..2 replicas and a target of one request each (after the failover
    test: it replaces the fixed two-replica deployment)."""
    from ray import serve

    from serving.config import EngineConfig, ServerConfig
    from serving.deploy import ray_app
    from serving.deploy.config import DeployConfig

    url, model = cluster
    engine = EngineConfig.from_kwargs(**ENGINE)
    deploy = DeployConfig(replicas=1, max_replicas=2, target_ongoing_requests=1.0, replica_cpus=0.5, drain_timeout_s=5)
    ray_app.start(engine, ServerConfig(host="127.0.0.1", port=int(url.rsplit(":", 1)[1])), deploy)
    running = lambda: serve.status().applications[ray_app.APP_NAME].deployments["engine"].replica_states.get("RUNNING")
    body = lambda i: {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": 32, "temperature": 0}
    peak, deadline = running(), time.monotonic() + 300
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        while peak < 2 and time.monotonic() < deadline:
            results = list(pool.map(lambda i: httpx.post(url + "/v1/completions", json=body(i), timeout=300), range(6)))
            assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
            peak = max(peak, running())
    assert peak == 2
    deadline = time.monotonic() + 180
    while running() > 1 and time.monotonic() < deadline:
        time.sleep(3)
    assert running() == 1
