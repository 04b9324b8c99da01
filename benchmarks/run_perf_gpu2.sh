# One H200 call (~8 min), issue 17: the 1,000 x (1,000 / 1,000) throughput run at Llama-3-8B shape with random bf16
# weights (round 1: 7,308 output tok/s; flags as round 1's), then the 8B decode at batch 1 / 64 with XLA's default
# command buffers and with command buffers around the whole loop (WHILE, CONDITIONAL added), same run.
#   run(command="bash benchmarks/run_perf_gpu2.sh", timeout_s=560)
set -x
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
F="grep -v ^WARNING\|Warn"
timeout 280 python3 benchmarks/throughput.py --preset llama3_8b --time_limit 230 --compilation_cache_dir /tmp/jax_cc \
  --out $OUT/throughput_llama3_8b_bf16.json 2>&1 | $F | grep -v "^ \"\(model\|engine\|num_kv\|executables\)" | tail -24
for CB in "" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"; do
  XLA_FLAGS="$CB" timeout 110 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --repeats 3 \
    --compilation_cache_dir '' --out "$OUT/decode_llama_cb${CB:+_on}.json" 2>&1 | $F | grep "llama3_8b\|rror" | tail -4
done
