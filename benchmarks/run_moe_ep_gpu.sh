# MoE expert parallelism by all-to-all (issue 14 item 3) on two H200s (~3 minutes of one device call):
#   run(kind="nvidia-h200-x2", command="bash benchmarks/run_moe_ep_gpu.sh", timeout_s=600)
# then copy $OUT/*.json to benchmarks/results/ and add the figures to BENCHMARKS.md.
# 1. One Mixtral-like MoE layer (bf16, D 4096, F 14336, 8 experts, top 2) split over 2 GPUs vs one GPU: the Mosaic
#    GPU grouped matmul inside the expert shard_map (never run on CPU) and the ragged_dot reference; error and time.
# 2. The all-to-all engine tests on the GPUs' own collectives (tiny models, greedy tokens equal one device).
set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 200 python benchmarks/moe_ep.py --ep 2 --tokens 16,256,2048 --out $OUT/moe_ep_h200x2.json 2>&1 \
  | grep -v "^WARNING\|Warn" | tail -8
timeout 200 python -c "
import jax, jax.numpy as jnp, numpy as np
from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.transformer import random_model
from serving.config import EngineConfig
from serving.engine.engine import LLMEngine
cfg = ModelConfig.tiny_moe(num_experts=8, num_heads=8, num_kv_heads=2)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 500, n).tolist() for n in (21, 3, 40)]
out = {}
for ep in (1, 2):
    e = LLMEngine(random_model(cfg, jnp.float32, seed=7), NullTokenizer(), EngineConfig.from_kwargs(
        max_num_seqs=4, max_num_batched_tokens=32, block_size=16, num_kv_blocks=64, decode_steps=4, max_model_len=128,
        warmup=False, compilation_cache_dir='', expert_parallel_size=ep))
    out[ep] = [list(o.token_ids) for o in e.generate([None] * 3, prompts, max_tokens=16, temperature=0.0, ignore_eos=True)]
print('engine ep=2 tokens equal ep=1:', out[1] == out[2])
" 2>&1 | grep -v "^WARNING\|Warn" | tail -3
