# Session 6, call 3 (one H200 call, <= ~590 s; carry .gpu_carry/a so that call 4, run_spec_loop_gpu.sh with
# .gpu_carry/b, finds half a parked in /tmp/gpuc): issue 17's perf17 rows, then issue 13's leftovers with tighter
# limits than run_quant_leftovers_gpu.sh.
#   run(command="bash benchmarks/run_session6_call3_gpu.sh", carry=[".gpu_carry/a"], timeout_s=595)
set -x
export PYTHONPATH=.
CC=/tmp/jax_cc
O=$OUT/perf17_llama3_8b.jsonl
timeout 230 python3 benchmarks/perf17.py --what ttft,profile,itl_load --time_limit 60 --duration 15 \
  --compilation_cache_dir $CC --trace_dir /tmp/perf17_trace --out $O > $OUT/perf17_engine.log 2>&1
echo "rc=$?"; grep "^perf17 " $OUT/perf17_engine.log; grep -v "^perf17 \|^{" $OUT/perf17_engine.log | tail -4
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 125 python3 benchmarks/perf17.py --what long --time_limit 100 \
  --compilation_cache_dir $CC --out $O > $OUT/perf17_long.log 2>&1
echo "rc=$?"; grep "^perf17 " $OUT/perf17_long.log; grep -v "^perf17 \|^{" $OUT/perf17_long.log | tail -4
export XLA_PYTHON_CLIENT_PREALLOCATE=false
F="grep -v ^WARNING\|Warn"
mkdir -p $OUT/tests
OUT=$OUT/tests bash benchmarks/run_gpu_tests.sh 85 \
  "tests/test_w8a8_matmul.py::TestGpu::test_matches_reference" tests/test_w8a8_matmul.py::test_quant_matmul_prefill_on_gpu \
  tests/test_act_quant.py tests/test_stream_matmul_mgpu.py::test_conversion_flags_on_gpu
timeout 50 python3 benchmarks/w8a8_matmul.py --model_path_only --out $OUT/w8a8_model_path_h200.json 2>&1 | $F | tail -12
timeout 85 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32 --repeats 3 \
  --formats int4_rtn --stream_layout --out $OUT/decode_int4_stream_llama3_8b.json 2>&1 | $F | grep "llama3_8b\|Error\|error" | tail -10
