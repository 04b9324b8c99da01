"""Prefix-cache affinity routing against Ray Serve's power-of-two router, on a multi-turn chat workload.

python -m benchmarks.ray_routing --replicas 2,4 --routers prefix,pow2

For each (replica count, router) a fresh Ray Serve application (serving/deploy) is deployed on a local Ray
cluster, so every run starts with empty prefix caches. The workload: `conversations` chats, each opening with one
of `system_prompts` long shared system prompts, `turns` user turns each; a turn's prompt is the whole
conversation so far (system prompt, earlier questions and the model's answers), so a replica that served the
conversation's previous turn holds most of the prompt in its radix cache. `concurrency` conversations run at
once (each sequentially, turn after turn). Every turn is a streaming chat completion. A warm-up of
`warmup_conversations` chats on other system prompts runs first, unmeasured, so that no compile lands in the
measured turns.

Reported per run: the prefix-cache hit rate (prompt tokens served from the replicas' caches / prompt tokens
looked up, from the per-replica /metrics counters, before and after the workload), the time to first token
(first content chunk) p50 / p90 / mean over all turns, and turns 2+ alone (where affinity matters), requests per
replica, and the wall time. Figures depend on the host: this measures routing, not engine speed.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import statistics
import sys
import time

import httpx
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", ["2"], "replica counts to run")
flags.DEFINE_list("routers", ["prefix", "pow2"], "routers to compare: prefix (ours), pow2 (Ray's default)")
flags.DEFINE_integer("conversations", 8, "chats in the workload")
flags.DEFINE_integer("system_prompts", 2, "distinct shared system prompts (conversation c uses c % n)")
flags.DEFINE_integer("turns", 3, "user turns per conversation")
flags.DEFINE_integer("concurrency", 4, "conversations in flight at once")
flags.DEFINE_integer("max_tokens", 8, "tokens per answer")
flags.DEFINE_integer("warmup_conversations", 4, "conversations run first, unmeasured, on other system prompts")
flags.DEFINE_integer("max_model_len", 1024, "engine max_model_len")
flags.DEFINE_integer("num_kv_blocks", 96, "KV blocks per replica (small pools make cache placement matter)")
flags.DEFINE_integer("max_num_seqs", 4, "sequences per replica step")
flags.DEFINE_float("replica_cpus", 0.5, "Ray CPUs reserved per replica (logical)")
flags.DEFINE_string("compilation_cache_dir", None, "XLA compilation cache shared by the runs' replicas")
flags.DEFINE_string("out", None, "write the results as JSON here")

TOPICS = ("rail travel in Japan", "museum visits in Italy", "hiking in Patagonia", "food markets in Mexico")


def system_prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    rules = " ".join(
        f"Rule {k}: when the customer asks about {topic}, answer briefly, cite the region, and do not invent "
        f"prices, timetables or opening hours (variant {i})."
        for k in range(1, 7)
    )
    return f"You are a travel assistant specialised in {topic}. {rules}"


def run_conversation(url: str, model: str, c: int, prompt_offset: int = 0) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt(prompt_offset + c % FLAGS.system_prompts)}]
    turns = []
    for t in range(FLAGS.turns):
        messages.append({"role": "user", "content": f"Traveller {c}, question {t + 1}: what should I see first?"})
        body = {"model": model, "messages": messages, "max_tokens": FLAGS.max_tokens, "temperature": 0.0}
        t0, ttft, text = time.perf_counter(), None, []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=600) as r:
            replica = r.headers.get("x-pallas-replica")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"conversation {c} turn {t}: {chunk['error']}")
                piece = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece or "")
        messages.append({"role": "assistant", "content": "".join(text)})
        turns.append({"conversation": c, "turn": t, "replica": replica, "ttft_s": ttft})
    return turns


def replica_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    total = lambda name: sum(float(v) for v in re.findall(rf'^{name}{{replica="[^"]+"}} (\S+)$', text, re.M))
    return total("pallas_serve_replica_prefix_hit_tokens_total"), total(
        "pallas_serve_replica_prefix_queried_tokens_total"
    )


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_one(num_replicas: int, router: str, port: int) -> dict:
    from ray import serve

    from serving.config import EngineConfig, ServerConfig
    from serving.deploy import ray_app
    from serving.deploy.config import DeployConfig
    from serving.deploy.prefix_index import AffinityPolicy

    engine = EngineConfig.from_kwargs(
        max_model_len=FLAGS.max_model_len,
        num_kv_blocks=FLAGS.num_kv_blocks,
        max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=128,
        attention_backend="xla",
        decode_steps=1,
        warmup=True,
        compilation_cache_dir=FLAGS.compilation_cache_dir,
    )
    deploy = DeployConfig(
        replicas=num_replicas,
        router=router,
        replica_cpus=FLAGS.replica_cpus,
        affinity=AffinityPolicy(block_size=engine.block_size),
    )
    t0 = time.perf_counter()
    ray_app.start(engine, ServerConfig(host="127.0.0.1", port=port), deploy)
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    started = time.perf_counter() - t0
    with concurrent.futures.ThreadPoolExecutor(FLAGS.concurrency) as pool:  # compiles what the steps need
        list(pool.map(lambda c: run_conversation(url, model, c, prompt_offset=100), range(FLAGS.warmup_conversations)))
    time.sleep(1.0)
    hits0, queried0 = replica_counters(url)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(FLAGS.concurrency) as pool:
        turns = [
            t for conv in pool.map(lambda c: run_conversation(url, model, c), range(FLAGS.conversations)) for t in conv
        ]
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # each replica reports its counters after a request's last output
    hits1, queried1 = replica_counters(url)
    serve.delete(ray_app.APP_NAME)
    ttft = [t["ttft_s"] for t in turns if t["ttft_s"] is not None]
    later = [t["ttft_s"] for t in turns if t["turn"] > 0 and t["ttft_s"] is not None]
    per_replica = {}
    for t in turns:
        per_replica[t["replica"]] = per_replica.get(t["replica"], 0) + 1
    sticky = sum(
        1 for c in range(FLAGS.conversations) if len({t["replica"] for t in turns if t["conversation"] == c}) == 1
    )
    return {
        "replicas": num_replicas,
        "router": router,
        "requests": len(turns),
        "prefix_hit_rate": (hits1 - hits0) / (queried1 - queried0) if queried1 > queried0 else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_later_turns_mean_s": statistics.fmean(later) if later else None,
        "conversations_on_one_replica": sticky,
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
        "workload_wall_s": wall,
        "startup_s": started,
    }


def main(argv) -> int:
    if len(argv) > 1:
        print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from benchmarks.local_server import free_port

    counts = [int(n) for n in FLAGS.replicas]
    bad = [r for r in FLAGS.routers if r not in ("prefix", "pow2")]
    if bad or min(counts) < 1:
        print(f"error: --routers takes prefix and pow2, --replicas positive counts (got {FLAGS.routers}, {counts})")
        return 2
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a shared host: no Ray OOM kills mid-run
    ray.init(
        num_cpus=max(4, 2 * max(counts)),
        object_store_memory=128 << 20,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    results, port = [], free_port()  # one Serve HTTP proxy for every run
    try:
        for n in counts:
            for router in FLAGS.routers:
                result = run_one(n, router, port)
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        f"{'replicas':>8} {'router':>6} {'hit rate':>8} {'TTFT p50':>9} {'p90':>7} {'mean':>7} {'turns 2+':>8} {'sticky':>6}"
    )
    for r in results:
        print(
            f"{r['replicas']:>8} {r['router']:>6} {r['prefix_hit_rate']:>8.3f} {r['ttft_p50_s']:>8.3f}s "
            f"{r['ttft_p90_s']:>6.3f}s {r['ttft_mean_s']:>6.3f}s {r['ttft_later_turns_mean_s']:>7.3f}s "
            f"{r['conversations_on_one_replica']:>3}/{FLAGS.conversations}"
        )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(
                {
                    "flags": {
                        k: FLAGS[k].value
                        for k in (
                            "conversations",
                            "system_prompts",
                            "turns",
                            "concurrency",
                            "max_tokens",
                            "num_kv_blocks",
                        )
                    },
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    app.run(main)
