# Issue 17, next device session (one H200 call, <= ~560 s; random weights, no carry needed):
#   1. the per-step profile at batch 1 / 64 / 256 again, after the decode loops queue their result copy at dispatch
#      (session 6's profile: 30-38% of each step GPU idle, one D2H -> H2D gap per loop of the host's whole apply),
#      with ITL under 0.8x-peak Poisson load, default scheduler;
#   2. ITL under the same load with max_prefill_tokens_while_decoding 512 (steps with 8,192-token chunks made p99
#      per-token ITL 17.6x idle);
#   3. the 1,000 x (1,000 / 1,000) throughput run with fp8 weights through the streaming kernel and fp8 KV (goal
#      17,600 output tok/s; bf16 + bf16 KV: 8,042).
#   run(command="bash benchmarks/run_next_perf_gpu.sh", timeout_s=570)
set -x
export PYTHONPATH=.
CC=/tmp/jax_cc
O=$OUT/perf17_llama3_8b.jsonl
timeout 200 python3 benchmarks/perf17.py --what profile,itl_load --time_limit 60 --duration 15 \
  --compilation_cache_dir $CC --trace_dir /tmp/perf17_trace --out $O > $OUT/perf17_engine.log 2>&1
echo "rc=$?"; grep "^perf17 profile batch\|^perf17 itl_load at" $OUT/perf17_engine.log
timeout 110 python3 benchmarks/perf17.py --what itl_load --duration 15 --max_prefill_tokens_while_decoding 512 \
  --compilation_cache_dir $CC --out $O > $OUT/perf17_itl_cap.log 2>&1
echo "rc=$?"; grep "^perf17 itl_load at" $OUT/perf17_itl_cap.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 benchmarks/throughput.py --preset llama3_8b --time_limit 190 \
  --quantization fp8 --kv_cache_dtype fp8 --stream_layout --compilation_cache_dir $CC \
  --out $OUT/throughput_llama3_8b_fp8_fp8kv.json 2>&1 | grep "output_tokens_per_s\|finished\|wall_s\|warmup_s\|rror" | tail -8
