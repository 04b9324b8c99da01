# One H200 call (~9 min): issue 13's per-format decode table at Llama-3-8B shape (random weights; bf16 weights are
# also issue 17's batch-1 / batch-64 rows) and issue 14's Mixtral-8x7B decode and grouped-matmul-vs-dense run.
#   run(command="bash benchmarks/run_quant_moe_gpu.sh", timeout_s=600)
# Parks .gpu_carry/a (half of the default model) in /tmp/gpuc for a following call (benchmarks/run_gpu_tests.sh).
set -x
export PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
mkdir -p /tmp/gpuc && cp -n .gpu_carry/*/part_* .gpu_carry/*/sha256 .gpu_carry/*/*.whl /tmp/gpuc/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
F="grep -v ^WARNING\|Warn"
timeout 250 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32 --repeats 3 \
  --formats bf16,int8,fp8,int4_rtn --out $OUT/decode_formats_llama3_8b.json 2>&1 | $F | grep "llama3_8b\|Error\|error" | tail -14
timeout 70 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32 --repeats 3 \
  --formats bf16,int4_rtn --kv_cache_dtypes int8 --out $OUT/decode_formats_kv_int8_llama3_8b.json 2>&1 | $F | grep "llama3_8b\|Error\|error" | tail -8
timeout 130 python3 benchmarks/decode_llama.py --preset mixtral_8x7b --batches 1,64 --ctx 1024 --steps 16 --repeats 3 \
  --out $OUT/decode_mixtral_8x7b.json 2>&1 | $F | grep "mixtral\|Error\|error" | tail -6
timeout 100 python3 benchmarks/grouped_matmul.py --moe_block_tokens 4096 --out $OUT/grouped_matmul.json 2>&1 | $F | tail -16
