#!/usr/bin/env bash
# Session 16's device calls (issue 17: the figures session 15 left without a profile or an answer).
#   fp8     the engine's traced decode step at batch 1 / 64 / 256 with fp8 weights (W8A16, streaming layout) and fp8
#           KV (session 9's 1,000 x 1,000 fp8 run, 7,364 tok/s, fell below bf16's 8,042 with no profile to say why);
#           then benchmarks/matmul_rows.py: the fp8 matmul per path and row count (1 .. 8,192) beside bf16's dot
#   w8a8    the 1,000 x (1,000 / 1,000) run with w8a8_fp8_rtn weights (prefill on the fp8 tensor cores) and int8 KV
#           (fused RoPE + page write), $TL s; then the traced decode step at batch 64 / 256 in that format
#   blocked session 15's A/B (run_session15_gpu.sh blocked): decode loops while waiting requests lack KV blocks,
#           on and off, the 1,000 x (1,000 / 1,000) bf16 run's first $TL seconds each
#   paged   the paged decode kernel's tiles per page dtype (int8, bf16) at batch 256 / 64, context 576 / 1,536
#           (benchmarks/paged_decode_sweep.py): int8 pages ran at ~2.0 TB/s in the W8A8 throughput step, bf16 ~3.0
#   fake    the act_quant GPU tests (fake_quantize included), then the W8A8 decode step traced at batch 64 / 256: what
#           the one-pass fake quantiser of decode-sized W8A8 calls saved against session 16's profile
#   tests   the GPU tests of the RoPE + KV-write kernel and the GEMV on the final code
source benchmarks/gpu_call_prelude.sh

w8a8_profile() {  # $1 timeout (s), $2 output name: the traced W8A8 fp8 + int8 KV decode step at batch 64 / 256
  timeout "$1" python3 benchmarks/perf17.py --what profile --batches 64,256 --quantization w8a8_fp8_rtn \
    --kv_cache_dtype int8 --compilation_cache_dir /tmp/jax_cc --trace_dir /tmp/perf17_w8a8 \
    --out "$OUT/$2.jsonl" > "$OUT/$2.log" 2>&1
  echo "rc=$?"; grep "^perf17 profile batch" "$OUT/$2.log" | cut -c1-600
}

case "$1" in
fp8)
  timeout 300 python3 benchmarks/perf17.py --what profile --quantization fp8 --stream_layout --kv_cache_dtype fp8 \
    --compilation_cache_dir /tmp/jax_cc --trace_dir /tmp/perf17_fp8 --out $OUT/perf17_fp8.jsonl > $OUT/perf17_fp8.log 2>&1
  echo "rc=$?"; grep "^perf17 profile batch" $OUT/perf17_fp8.log | cut -c1-600
  timeout ${MR_TL:-230} python3 benchmarks/matmul_rows.py --shapes 4096x28672,4096x6144 --rows 1,64,256,512,2048,8192 \
    --paths bf16,engine,xla_dequant,stream,w8a8 --budget_s $((${MR_TL:-230} - 40)) --out $OUT/matmul_rows.json 2>&1 \
    | grep "^matmul_rows"
  ;;
w8a8)
  timeout $((${TL:-220} + 180)) python3 benchmarks/throughput.py --preset llama3_8b --time_limit ${TL:-220} \
    --quantization w8a8_fp8_rtn --kv_cache_dtype int8 --compilation_cache_dir /tmp/jax_cc \
    --out $OUT/throughput_w8a8_fp8_rtn_int8kv.json 2>&1 | grep -v Warning | tail -40
  w8a8_profile ${PT:-170} perf17_w8a8
  ;;
blocked)
  bash benchmarks/run_session15_gpu.sh blocked  # session 15's A/B as written there ($TL seconds each)
  ;;
paged)
  timeout 280 python3 benchmarks/paged_decode_sweep.py --budget_s 230 --out $OUT/paged_decode_sweep.json 2>&1 \
    | grep "^paged_decode_sweep" | cut -c1-300
  ;;
fake)
  timeout 120 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/test_act_quant.py tests/test_w8a8_layout.py 2>&1 \
    | tee "$OUT/act_quant_gpu_tests.log" | tail -4
  w8a8_profile 330 perf17_w8a8_fake
  ;;
tests)
  timeout 150 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/test_rope_kv_write.py tests/test_gemv.py 2>&1 \
    | tee "$OUT/rope_gemv_gpu_tests.log" | tail -4
  ;;
esac
