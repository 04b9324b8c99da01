# One H200 call (~9.5 min): the GPU tests of the new Mosaic GPU kernels (streaming decode matmul, W8A8, grouped
# matmul), issue 13's per-format decode table at Llama-3-8B shape (random weights; the bf16 rows are also issue 17's
# batch-1 / batch-64 figures) and issue 14's Mixtral-8x7B decode and grouped-matmul-vs-dense run.
#   run(command="bash benchmarks/run_quant_moe_gpu.sh", carry=[".gpu_carry/a"], timeout_s=600)
# Parks .gpu_carry/a (half of the default model) in /tmp/gpuc for the next call (benchmarks/run_spec_engine_gpu.sh).
set -x
bash benchmarks/run_gpu_tests.sh 100 tests/test_stream_matmul_mgpu.py tests/test_w8a8_matmul.py tests/test_grouped_matmul.py
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
F="grep -v ^WARNING\|Warn"
timeout 230 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32 --repeats 3 \
  --formats bf16,int8,fp8,int4_rtn --out $OUT/decode_formats_llama3_8b.json 2>&1 | $F | grep "llama3_8b\|Error\|error" | tail -14
timeout 40 python3 benchmarks/decode_llama.py --preset llama3_8b --batches "" --formats bf16,int4_rtn \
  --kv_cache_dtypes auto,int8 --out $OUT/concurrency_llama3_8b.json 2>&1 | $F | grep "llama3_8b\|Error\|error" | tail -6
timeout 120 python3 benchmarks/decode_llama.py --preset mixtral_8x7b --batches 1,64 --ctx 1024 --steps 16 --repeats 3 \
  --out $OUT/decode_mixtral_8x7b.json 2>&1 | $F | grep "mixtral\|Error\|error" | tail -6
timeout 90 python3 benchmarks/grouped_matmul.py --moe_block_tokens 4096 --out $OUT/grouped_matmul.json 2>&1 | $F | tail -16
