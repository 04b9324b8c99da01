# Issue 17's H200 figures not yet measured, as one device call (~9.5 min; each step's JSON is written as it ends):
#   run(command="bash benchmarks/run_perf_gpu.sh", timeout_s=600)
# 1. The 1,000 x (1,000 / 1,000) throughput run at Llama-3-8B shape, random bf16 weights (round 1: 7,308 tok/s).
# 2. The decode loop with XLA command buffers around the whole step (SmolLM2 on the H200 runs ~540 kernels a token;
#    the 8B batch-1 step is 5.07 ms against a ~4.2 ms weight-read floor): the same decode_llama rows both ways.
# 3. FlashAttention forward+backward and the ragged mixed batch against cuDNN / the two-kernel split, same run.
set -x
export PYTHONPATH=.
F="grep -v ^WARNING\|Warn"
timeout 250 python3 benchmarks/throughput.py --preset llama3_8b --time_limit 200 --out $OUT/throughput_llama3_8b.json \
  2>&1 | $F | tail -8
for CB in "" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"; do
  XLA_FLAGS="$CB" timeout 80 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --repeats 3 \
    --out "$OUT/decode_llama_cb${CB:+_on}.json" 2>&1 | $F | grep "llama3_8b\|rror" | tail -4
done
timeout 150 python3 benchmarks/kernels_flash.py --quick --json flash_quick.json 2>&1 | $F | tail -14
timeout 60 python3 benchmarks/kernels_paged.py --skip-decode --out $OUT/ragged_mixed.json 2>&1 | $F | tail -8
