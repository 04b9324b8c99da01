# Issue 12's saturation figure, rerun with the engine's warm-up (session 11's runs were each dominated by one stall;
# BENCHMARKS.md "H200 session 11"). The default model arrives in two halves (benchmarks/gpu_model_setup.sh):
#   run(command="source benchmarks/gpu_model_setup.sh", carry=[".gpu_carry/a"], timeout_s=60)   parks half a
#   run(command="bash benchmarks/run_session12_gpu.sh trace", carry=[".gpu_carry/b"], timeout_s=590)
#     off vs adaptive per step at the saturating rate, compiles counted per step (a stall shows its cause)
#   run(command="bash benchmarks/run_session12_gpu.sh load", timeout_s=590)
#     the load trade with --warmup serve (engine warm-up + pass + untimed schedule) and a schedule that
#     saturates for seconds
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
if [ "$1" = trace ]; then
  timeout 560 python3 benchmarks/spec_load_trace.py --preset smollm2 --rate 128 --num_requests 256 --max_tokens 120 \
    --max_num_seqs 32 --memory_budget_gb 4 --spec_batch_threshold 8 --out $OUT/spec_load_trace_h200_256.json \
    > $OUT/trace.log 2>&1
  echo "trace rc=$?"; grep -v -i warn $OUT/trace.log | cut -c1-300 | tail -60
  exit 0
fi
timeout 560 python3 benchmarks/spec_load.py --preset smollm2 --rates 16,128 --num_requests 256 --max_tokens 120 \
  --max_num_seqs 32 --memory_budget_gb 4 --spec_batch_threshold 8 --warmup serve \
  --out $OUT/spec_load_h200_smollm2_256.json > $OUT/spec_load.log 2>&1
echo "spec_load rc=$?"; grep -E '^\{' $OUT/spec_load.log | cut -c1-400
