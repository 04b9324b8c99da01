# Session 7, call 2 on one H200 (carry .gpu_carry/a, ~9 min): the fp8 W8A8 promotion and act_quant GPU tests and
# benchmark (benchmarks/run_w8a8_promotion_gpu.sh, the tests of run_quant_leftovers_gpu.sh); ITL under load with the
# prefill cap at 256; then the 1,000 x (1,000 / 1,000) throughput run with fp8 weights (streaming layout) and fp8 KV,
# its whole log kept (call 1's run printed nothing through its grep).
#   run(command="bash benchmarks/run_session7_call2_gpu.sh", carry=[".gpu_carry/a"], timeout_s=590)
set -x
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
bash benchmarks/run_w8a8_promotion_gpu.sh
mkdir -p $OUT/tests2
OUT=$OUT/tests2 bash benchmarks/run_gpu_tests.sh 60 tests/test_w8a8_matmul.py::test_quant_matmul_prefill_on_gpu \
  tests/test_act_quant.py tests/test_stream_matmul_mgpu.py::test_conversion_flags_on_gpu
timeout 105 python3 benchmarks/perf17.py --what itl_load --duration 15 --max_prefill_tokens_while_decoding 256 \
  --compilation_cache_dir /tmp/jax_cc --out $OUT/perf17_itl_cap256.jsonl > $OUT/perf17_itl_cap256.log 2>&1
echo "rc=$?"; grep "^perf17 itl_load at" $OUT/perf17_itl_cap256.log
timeout 215 python3 benchmarks/throughput.py --preset llama3_8b --time_limit 170 \
  --quantization fp8 --kv_cache_dtype fp8 --stream_layout --compilation_cache_dir /tmp/jax_cc \
  --out $OUT/throughput_llama3_8b_fp8_fp8kv.json > $OUT/throughput_fp8.log 2>&1
echo "rc=$?"; grep -v "^WARNING\|Warn" $OUT/throughput_fp8.log | tail -25
