# Issue 17 item 5 (b): the worked example at Llama-3-8B shape with random weights on one H200. Written and
# checked on CPU only (not yet run on a GPU). One device call:
#   run(command="bash benchmarks/run_worked_example_gpu.sh", timeout_s=600)
# then copy $OUT/worked_example_h200_llama3_8b.{json,png} to benchmarks/results/ and add the table to BENCHMARKS.md.
# The JSON is rewritten after every step, so a run cut short keeps the steps it finished.
#
# Quality is n/a (random weights). The speculative steps use ReplayProposer (serving/engine/proposers.py): the
# target's own greedy continuation recorded in step 4 (same weights and KV), each draft token corrupted with
# probability 1 - ACC, where ACC is the per-token acceptance SmolLM2's n-gram speculation measured in (a)
# (benchmarks/results/worked_example_cpu.json, step spec_always); the JSON labels those rows proposer=replay.
# Memory budget 15.3 GiB = the bf16 weights (15.0 GiB) + a KV pool for ~8 sequences, so the baseline's concurrency
# is KV-bound as in the seed; int8 weights free ~6.5 GiB for pages (capped at max_num_seqs 16).
# Compile cost: ~15 executables per engine; steps 5 and 6 load step 4's from the persistent cache.
set -x
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used --format=csv
ACC=${ACC:-$(python -c "import json; r=json.load(open('benchmarks/results/worked_example_cpu.json')); print(next(s['acceptance'] for s in r['steps'] if s['step']=='spec_always'))")}
timeout 560 python benchmarks/worked_example.py --preset llama3_8b --dtype bfloat16 --replay_acceptance "$ACC" \
  --num_requests 48 --rate 6 --max_tokens 120 --prompt_tokens 64 192 --memory_budget_gb 15.3 --max_num_seqs 16 \
  --max_num_batched_tokens 256 --num_speculative_tokens 4 --spec_batch_threshold 8 --quality_seqs 0 \
  --compilation_cache_dir /tmp/jax_cc --out "$OUT/worked_example_h200_llama3_8b.json" 2>&1 | grep -v "^WARNING\|Warn" | tail -12
