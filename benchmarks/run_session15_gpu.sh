#!/usr/bin/env bash
# Session 15's device calls (issue 17 item 2: RoPE + the KV-page write as one kernel, pallas_kernels/rope_kv_write.py).
#   rope    GPU tests of the new kernel and of the GEMV; the kernel alone against the unfused XLA ops per call
#           (benchmarks/rope_kv_write.py, 8B attention shape, bf16 and int8 pages); then Llama-3-8B shape, random
#           weights, decode at batch 1 and 64, bf16 and int8 KV, fused on and off in one run, each traced (per-step
#           kernel breakdown: the rope_kv category against the elementwise and copy kernels it replaces)
#   perf    the engine's per-step profile at batch 1 / 64 / 256 and the 1,000-token TTFT with the kernel (perf17.py),
#           the TTFT again without it, then the 1,000 x (1,000 / 1,000) bf16 throughput run in what time is left
#   blocked the 1,000 x (1,000 / 1,000) bf16 run twice, $TL seconds each: decode loops also while waiting requests lack KV
#           blocks (on, this session's rule) and the rule before it (off), the same workload's first $TL seconds
#   overlap the engine's decode step at batch 1 / 64 / 256 without the profiler, chained loops on and off (is the
#           traced one-gap-per-loop the host's apply in series with the GPU, or the profiler's own host overhead?)
#   fp8     the traced step profile at batch 1 / 64 / 256 with fp8 weights (stream layout) and fp8 KV, then int8 KV:
#           session 9's fp8 + fp8 KV 1000 x 1000 run (7,364 tok/s) fell below bf16's 8,042 with no profile to say why
#   Next session, in this order: `TL=120 ... blocked`, then `overlap`, then `fp8` (each its own call).
#   engine  the engine GPU tests (carry .gpu_carry/c after calls that carried .gpu_carry/a and /b on the same warm machine)
source benchmarks/gpu_call_prelude.sh
case "$1" in
rope)
  timeout 100 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/test_rope_kv_write.py tests/test_gemv.py 2>&1 \
    | tee "$OUT/rope_gemv_gpu_tests.log" | tail -4
  timeout 120 python3 benchmarks/rope_kv_write.py --out "$OUT/rope_kv_write.json" 2>&1 | tee "$OUT/rope_kv_write.log" \
    | grep -v Warning
  timeout 330 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32 --repeats 3 \
    --formats bf16 --kv_cache_dtypes auto,int8 --fused_rope on,off --compilation_cache_dir "" \
    --trace_dir /tmp/traces --out "$OUT/decode_fused_rope.json" 2>&1 | tee "$OUT/decode_fused_rope.log" | grep -v Warning
  ;;
perf)
  CC=/tmp/jax_cc; O=$OUT/perf17_session15.jsonl
  timeout 230 python3 benchmarks/perf17.py --what profile,ttft --ttft_backends pallas --compilation_cache_dir $CC \
    --trace_dir /tmp/perf17_trace --out $O > $OUT/perf17_on.log 2>&1; echo "rc=$?"; grep "^perf17 " $OUT/perf17_on.log | cut -c1-400
  timeout 110 python3 benchmarks/perf17.py --what ttft --ttft_backends pallas --fused_rope off --compilation_cache_dir $CC \
    --out $O > $OUT/perf17_off.log 2>&1; echo "rc=$?"; grep "^perf17 ttft" $OUT/perf17_off.log | cut -c1-400
  timeout 220 python3 benchmarks/throughput.py --preset llama3_8b --time_limit 170 --compilation_cache_dir $CC \
    --out $OUT/throughput_llama3_8b_bf16.json 2>&1 | tee $OUT/throughput.log | grep -v Warning | tail -12
  ;;
blocked)
  for rule in on off; do
    timeout $((${TL:-120} + 200)) python3 benchmarks/throughput.py --preset llama3_8b --time_limit ${TL:-120} \
      --loop_while_blocked $rule --compilation_cache_dir /tmp/jax_cc --out $OUT/throughput_blocked_$rule.json 2>&1 \
      | grep -E '"(finished|steps|decode_loops|output_tokens|output_tokens_per_s|preemptions|warmup_s|num_kv_blocks)"'
  done
  ;;
overlap)
  for a in on off; do
    timeout 250 python3 benchmarks/perf17.py --what profile --no_trace --async_scheduling $a --compilation_cache_dir /tmp/jax_cc \
      --out $OUT/perf17_overlap.jsonl 2>&1 | grep "^perf17 profile batch"
  done
  ;;
fp8)
  for kv in fp8 int8; do
    timeout 280 python3 benchmarks/perf17.py --what profile --quantization fp8 --stream_layout --kv_cache_dtype $kv \
      --compilation_cache_dir /tmp/jax_cc --trace_dir /tmp/perf17_fp8_$kv --out $OUT/perf17_fp8.jsonl 2>&1 \
      | grep "^perf17 profile batch" | cut -c1-400
  done
  ;;
engine)
  [ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
  timeout 560 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_spec_device_loop.py \
    tests/test_quantized_matmul.py tests/test_gguf_quant.py 2>&1 | tee "$OUT/engine_gpu_tests.log" | tail -30
  ;;
esac
