# Session 12's H200 calls. The default model arrives in two halves (benchmarks/gpu_model_setup.sh):
#   run(command="bash benchmarks/run_session12b_gpu.sh park", carry=[".gpu_carry/a"], timeout_s=300)
#     parks half a; the GPU tests that need no model (speculative device loop with n-gram and a twin draft model)
#   run(command="bash benchmarks/run_session12b_gpu.sh trace", carry=[".gpu_carry/b"], timeout_s=600)
#     the engine's GPU tests on SmolLM2 (warm_chain's first GPU run), then issue 12's saturation per step: off vs
#     adaptive at the saturating rate, compiles counted per step
#   run(command="bash benchmarks/run_session12b_gpu.sh load", timeout_s=600)
#     batch 1 with the draft models inside the device loop; then the load trade with --warmup serve, 256 requests
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
if [ "$1" = park ]; then
  timeout 250 python3 -m pytest -q -p no:cacheprovider -n 2 -m gpu -rf tests/test_spec_device_loop.py > $OUT/gpu_tests_spec.log 2>&1
  echo "spec loop gpu tests rc=$?"; tail -4 $OUT/gpu_tests_spec.log
  exit 0
fi
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
if [ "$1" = trace ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -n 2 -m gpu -rf tests/test_engine_gpu.py > $OUT/gpu_tests_engine.log 2>&1
  echo "engine gpu tests rc=$?"; tail -4 $OUT/gpu_tests_engine.log
  timeout 420 python3 benchmarks/spec_load_trace.py --preset smollm2 --rate 128 --num_requests 256 --max_tokens 120 \
    --max_num_seqs 32 --memory_budget_gb 4 --spec_batch_threshold 8 --out $OUT/spec_load_trace_h200_256.json \
    > $OUT/trace.log 2>&1
  echo "trace rc=$?"; grep -v -i warn $OUT/trace.log | cut -c1-300 | tail -40
  exit 0
fi
timeout 150 python3 benchmarks/spec_engine.py --prompt_chars 1500 --k 3 --max_tokens 128 --max_num_seqs 1 \
  --methods off,ngram_device,self_device,draft_device --self_layers 20 --draft_layers 20 --warmup engine \
  --prompts_per_domain 2 --dtype bfloat16 --out $OUT/spec_engine_h200_draft_device.json > $OUT/spec_b1.log 2>&1
echo "batch-1 rc=$?"; grep -E "^(off|ngram_device|self_device|draft_device) " $OUT/spec_b1.log | cut -c1-400
timeout 420 python3 benchmarks/spec_load.py --preset smollm2 --rates 16,128 --num_requests 256 --max_tokens 120 \
  --max_num_seqs 32 --memory_budget_gb 4 --spec_batch_threshold 8 --warmup serve \
  --out $OUT/spec_load_h200_smollm2_256.json > $OUT/spec_load.log 2>&1
echo "spec_load rc=$?"; grep -E '^\{' $OUT/spec_load.log | cut -c1-400
