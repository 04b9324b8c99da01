"""The HF architectures under tensor parallelism on forced CPU devices: tiny checkpoints of tests/data/hf_tiny/
(4 query / 2 KV heads) served with tensor_parallel_size=2 (Qwen3-MoE: its experts split expert_parallel_size=2
too) generate Hugging Face's greedy continuations, token for token (XLA attention; the kernels' shard_map path is
the one model/kv.py runs for any model). One fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import json

import pytest

from tests.script_run import run_script

SCRIPT = r"""
import json, os, sys
import numpy as np
from checkpoints import hf
from serving.engine.llm import LLM

data = os.path.join("tests", "data", "hf_tiny")
done = []
for name, degrees in json.loads(sys.argv[1]):
    with open(os.path.join(data, name, "oracle.json")) as f:
        oracle = json.load(f)
    cfg, params = hf.load_hf(os.path.join(data, name), dtype=np.float32)
    llm = LLM.from_params(cfg, params, dtype="float32", max_num_seqs=3, max_num_batched_tokens=16, block_size=4,
                          num_kv_blocks=40, max_model_len=48, attention_backend="xla", decode_steps=1, warmup=False,
                          compilation_cache_dir="", **degrees)
    got = [o.token_ids for o in llm.generate(oracle["prompts"], max_tokens=12, temperature=0.0, ignore_eos=True)]
    assert got == oracle["greedy"], (name, degrees, got, oracle["greedy"])
    done.append(name)
print("ok", json.dumps(done))
"""

CASES = [
    ("qwen3", {"tensor_parallel_size": 2}),
    ("gemma2", {"tensor_parallel_size": 2}),
    ("phi3", {"tensor_parallel_size": 2}),
    ("qwen3_moe", {"tensor_parallel_size": 2, "expert_parallel_size": 2}),
]


@pytest.mark.slow
def test_hf_architectures_tensor_parallel():
    assert run_script(SCRIPT, json.dumps(CASES), devices=4, timeout=900) == [name for name, _ in CASES]
