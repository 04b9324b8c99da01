"""A Ray Serve engine replica spanning two hosts, on a local Ray cluster of two nodes (ray.cluster_utils.Cluster).

The replica's placement group has one bundle per node (STRICT_SPREAD): the replica actor in bundle 0 is process 0 of
a `jax.distributed` job and serves; a follower actor in bundle 1 is process 1 and replays its steps
(serving/deploy/multihost.py). The engine is the default SmolLM2 with pipeline_parallel_size=2 over the two
processes' CPU devices, one stage per "host" (its 9 attention heads do not split over 2 tensor-parallel devices;
pipeline stages across hosts and tensor parallelism inside one are also the usual layout of a real multi-host
replica). Completions through the ingress must equal a one-process engine's greedy output, both bundles must land
on different nodes, and deleting the application must end both processes.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

ENGINE = dict(
    max_model_len=128,
    num_kv_blocks=24,
    max_num_seqs=2,
    max_num_batched_tokens=64,  # both prompts' prefill in one step: one token bucket to compile
    attention_backend="xla",
    decode_steps=1,
    warmup=False,
    compilation_cache_dir="",
)
PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 10
SLOW = os.environ.get("PALLAS_SERVE_SLOW_TESTS")


def _tiny_checkpoint(directory: str) -> None:
    """A random tiny Llama (8 query / 2 KV heads: tensor parallel over 2 splits both) with a byte-level tokenizer,
    saved as an Orbax checkpoint every Ray worker loads like any model directory."""
    import jax.numpy as jnp
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from checkpoints import orbax_io
    from checkpoints.tokenizer import Tokenizer
    from model.config import ModelConfig
    from model.transformer import model_params, random_model

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, vocab_size=len(vocab), eos_token_ids=(0,))
    model = random_model(cfg, jnp.float32, seed=5)
    orbax_io.save(directory, cfg, model_params(model), Tokenizer(hf, eos_token_ids=(0,)))


@pytest.fixture(
    scope="module",
    params=[
        "tiny-tp2",
        pytest.param(
            "smollm2-pp2",
            marks=[pytest.mark.slow, pytest.mark.skipif(not SLOW, reason="2 SmolLM2 processes: ~6 minutes")],
        ),
    ],
)
def prepared(request, tmp_path_factory):
    """(engine options, reference) as futures of one thread, which writes the checkpoint, then runs the prompts on
    one engine in this process while the Ray cluster starts (the phases overlap on the 2-core host).

    The replica's engine: a tiny checkpoint with tensor_parallel_size=2 (one KV head and 4 query heads per
    process), or the default SmolLM2 with pipeline_parallel_size=2 (15 layers per process; its 9 heads do not
    split over 2 devices, and pipeline stages across hosts are the usual layout of a large replica anyway)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        options = pool.submit(_engine_options, request.param, tmp_path_factory)
        reference = pool.submit(lambda: _one_engine(options.result()))
        yield options, reference


def _engine_options(case: str, tmp_path_factory) -> dict:
    if case == "tiny-tp2":
        model = str(tmp_path_factory.mktemp("ckpt") / "tiny")
        _tiny_checkpoint(model)
        return ENGINE | {"model": model, "tensor_parallel_size": 2}
    return ENGINE | {"pipeline_parallel_size": 2}


def _one_engine(options: dict) -> tuple[list[str], list[int]]:
    """The prompts' greedy completions on one engine, one device: (texts, token counts)."""
    from serving.engine.llm import LLM

    options = {k: v for k, v in options.items() if not k.endswith("parallel_size")}
    outs = LLM(**options).generate(PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.text for o in outs], [len(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def spanning_app(prepared):
    """(url, model): one application, one engine replica over 2 nodes of 1 CPU each (Serve's own actors ask
    for no CPU)."""
    from ray import serve
    from ray.cluster_utils import Cluster

    from serving.config import EngineConfig, ServerConfig
    from serving.deploy import ray_app
    from serving.deploy.config import DeployConfig
    from tests.live_app import free_port

    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # shared host: see tests/test_ray_serve.py
    # The cluster's processes inherit this one's environment: one CPU device each, as on a real host of one device,
    # whatever device count another test module of this worker asked for (tests/test_sharding.py asks for 8).
    xla_flags = os.environ.get("XLA_FLAGS")
    own = [f for f in (xla_flags or "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(own)
    node = dict(num_cpus=1, object_store_memory=80 << 20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    server = ServerConfig(host="127.0.0.1", port=free_port())
    deploy = DeployConfig(
        replicas=1,
        hosts_per_replica=2,
        replica_cpus=1.0,
        router="pow2",
        health_check_period_s=2.0,
        drain_timeout_s=10.0,
    )
    try:
        cluster.add_node(**node)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        ray_app.start(EngineConfig.from_kwargs(**prepared[0].result()), server, deploy)
        url = f"http://127.0.0.1:{server.port}"
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        yield url, model
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        if xla_flags is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = xla_flags


@pytest.fixture(scope="module")
def reference(prepared):
    """The prompts on one engine in this process: (texts, completion token counts)."""
    return prepared[1].result()


def test_spanning_replica_matches_one_engine(spanning_app, reference):
    url, model = spanning_app
    body = {"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["x-pallas-replica"]
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == reference[0]
    assert r.json()["usage"]["completion_tokens"] == sum(reference[1]) == MAX_TOKENS * len(PROMPTS)
    assert _follower_names() == [f"pallas-serve-{r.headers['x-pallas-replica']}-host1"]


def _spanning_group():
    """(placement group id, node of each bundle) of the application's one 2-bundle placement group."""
    groups = [
        (pg_id, [g["bundles_to_node_id"][i] for i in sorted(g["bundles_to_node_id"])])
        for pg_id, g in ray.util.placement_group_table().items()
        if g["state"] == "CREATED" and len(g["bundles"]) == 2
    ]
    assert len(groups) == 1, ray.util.placement_group_table()
    return groups[0]


def _follower_names() -> list[str]:
    from serving.deploy.multihost import FOLLOWER_NAMESPACE

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == FOLLOWER_NAMESPACE]


def _replica_pids() -> list[int]:
    """Processes of this test's Ray cluster (children of this process) running an engine replica."""
    import psutil

    procs = psutil.Process().children(recursive=True)
    return [p.pid for p in procs if "ServeReplica:pallas-serve:engine" in " ".join(_cmdline(p))]


def _cmdline(proc) -> list[str]:
    import psutil

    try:
        return proc.cmdline()
    except psutil.Error:  # ended meanwhile
        return []


def _complete(url: str, model: str) -> list[str]:
    body = {"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="starts a second replica: ~1 minute")
def test_a_lost_host_replaces_the_whole_replica(spanning_app, reference):
    """Killing the follower (a host lost) takes its replica down; Ray starts a new group (new placement group,
    new follower) that answers as before."""
    from ray import serve

    from serving.deploy.multihost import FOLLOWER_NAMESPACE
    from serving.deploy.ray_app import APP_NAME

    url, model = spanning_app
    (old,) = _follower_names()
    old_group, _ = _spanning_group()
    ray.kill(ray.get_actor(old, namespace=FOLLOWER_NAMESPACE), no_restart=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        engine = serve.status().applications[APP_NAME].deployments["engine"]
        names = _follower_names()
        if names and names != [old] and engine.replica_states.get("RUNNING", 0) == 1:
            break
        time.sleep(2)
    assert names and names != [old] and engine.replica_states.get("RUNNING", 0) == 1, (names, engine)
    assert _spanning_group()[0] != old_group
    assert _complete(url, model) == reference[0]


def test_bundles_on_two_nodes_and_deleting_the_app_ends_both_processes(spanning_app):
    from ray import serve

    from serving.deploy.multihost import FOLLOWER_NAMESPACE
    from serving.deploy.ray_app import APP_NAME

    url, _ = spanning_app
    pg_id, nodes = _spanning_group()
    assert len(set(nodes)) == 2 and set(nodes) <= {n["NodeID"] for n in ray.nodes() if n["Alive"]}, nodes
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    (name,) = _follower_names()  # the one replica's one follower
    assert name.startswith("pallas-serve-") and name.endswith("-host1"), name
    follower = ray.get_actor(name, namespace=FOLLOWER_NAMESPACE)
    node, pid = ray.get(follower.where.remote(), timeout=30)
    assert node == nodes[1], (node, nodes)  # process 1 of the JAX job runs in bundle 1, on the other node
    (leader,) = _replica_pids()
    serve.delete(APP_NAME)  # the replica drains, stops its follower and leaves the JAX job
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (_alive(pid) or _alive(leader)):
        time.sleep(0.5)
    assert not _alive(pid) and not _alive(leader), f"follower {pid} or replica {leader} still running"
    with pytest.raises(ValueError):
        ray.get_actor(name, namespace=FOLLOWER_NAMESPACE)
    table = ray.util.placement_group_table()
    assert table.get(pg_id, {}).get("state", "REMOVED") == "REMOVED", table.get(pg_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
