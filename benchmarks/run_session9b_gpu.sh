# Session 9, call 3 on one H200 (no model needed): the fp8-weight + fp8-KV 1000 x (1000 / 1000) throughput run at
# Llama-3-8B shape with its whole log (it printed nothing twice under a 215 s limit), then the W8A8 model path's
# fp8 error split (quantiser vs kernel vs reference) at 4096 x 4096, M = 4096.
#   run(command="bash benchmarks/run_session9b_gpu.sh", timeout_s=590)
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
timeout 470 python3 benchmarks/throughput.py --preset llama3_8b --time_limit 300 \
  --quantization fp8 --kv_cache_dtype fp8 --stream_layout \
  --out $OUT/throughput_llama3_8b_fp8_fp8kv.json > $OUT/throughput_fp8.log 2>&1
echo "throughput rc=$?"; grep -v "^WARNING\|Warn\|^W[0-9]\|^I[0-9]" $OUT/throughput_fp8.log | tail -30
timeout 90 python3 benchmarks/w8a8_matmul.py --model_path_only --shapes q_o_4096x4096 \
  --out $OUT/w8a8_model_path_h200.json > $OUT/w8a8_model_path.log 2>&1
echo "w8a8 rc=$?"; grep -v "^WARNING\|Warn" $OUT/w8a8_model_path.log | tail -12
