#!/usr/bin/env bash
# Session 14's device calls (issues 13 / 17: the GEMV's first run on GPU in loop mode, and its whole-step effect).
#   sweep   GPU tests of pallas_kernels/gemv.py (the loop driver's first GPU run), then the loop / small-program
#           sweep at M = 1 for every format with the table beside XLA, the tensor-core kernel and cuBLAS; then Nsight
#           Compute on the GEMV (4096x14336, M = 1, tuned configs): DRAM throughput, issue use, warp stall reasons
#   decode  Llama-3-8B shape, random weights, batch-1 decode per weight format, GEMV on and off in one run, with the
#           configs of $GEMV_CONFIGS (the sweep's JSON, carried back in as an untracked file) when given
#   all     one call of everything above but the engine tests (machines were scarce): GPU tests, a shorter sweep +
#           table, decode with the sweep's best configs (GEMV on, traced; and off), then ncu on int4_g128
#   ncu     Nsight Compute on the GEMV alone for $NCU_FORMATS (benchmarks/profile_stream_ncu.sh gemv)
#   streamcmp  8B batch-1 decode of int8 / fp8 / int4 with the Mosaic stream layout copy, GEMV on (it serves one-row
#           calls first) against off (the stream kernel serves them): which of the two the H200 should use at M = 1
#   engine  the engine GPU tests (carry .gpu_carry/c after calls that carried .gpu_carry/a and /b on the same warm machine)
source benchmarks/gpu_call_prelude.sh
case "$1" in
sweep)
  timeout 150 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/test_gemv.py 2>&1 | tee "$OUT/gemv_gpu_tests.log" | tail -15
  timeout 400 python3 benchmarks/gemv.py --sweep --budget_s 250 --rows 1 --formats bf16,int8,fp8,int4_g128,int4_g32_asym,int8_g32 \
    --shapes 4096x6144,4096x1024,4096x28672,14336x4096,4096x14336 --out "$OUT/gemv_sweep.json" 2>&1 | tee "$OUT/gemv_sweep.log" | grep -v "^sweep"
  bash $0 ncu
  ;;
decode)
  CONFIGS=""; [ -n "$GEMV_CONFIGS" ] && CONFIGS="--gemv_configs $GEMV_CONFIGS"
  timeout 560 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1 --ctx 1024 --steps 32 --repeats 3 \
    --formats ${FORMATS:-bf16,int4_rtn,int8,fp8} --gemv on,off $CONFIGS --compilation_cache_dir "" \
    --trace_dir /tmp/traces --out "$OUT/decode_gemv.json" 2>&1 | tee "$OUT/decode_gemv.log" | grep -v Warning
  ;;
all)
  timeout 70 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/test_gemv.py 2>&1 | tee "$OUT/gemv_gpu_tests.log" | tail -3
  timeout 170 python3 benchmarks/gemv.py --sweep --budget_s 80 --rows 1 --formats bf16,int4_g128,int8,fp8,int4_g32_asym \
    --shapes 4096x6144,4096x28672,14336x4096,4096x14336 --out "$OUT/gemv_sweep.json" 2>&1 | tee "$OUT/gemv_sweep.log" | grep -v "^sweep"
  GEMV_CONFIGS=$OUT/gemv_sweep.json FORMATS=bf16,int4_rtn,int8,fp8 timeout 190 bash $0 decode
  NCU_FORMATS=int4_g128 timeout 60 bash $0 ncu
  ;;
ncu)
  bash benchmarks/profile_stream_ncu.sh gemv ${NCU_FORMATS:-bf16 int8 int4_g128}
  ;;
streamcmp)
  timeout 560 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1 --ctx 1024 --steps 32 --repeats 3 \
    --formats ${FORMATS:-int8,fp8,int4_rtn} --gemv on,off --stream_layout --compilation_cache_dir "" \
    --out "$OUT/decode_streamcmp.json" 2>&1 | tee "$OUT/decode_streamcmp.log" | grep -v Warning
  ;;
engine)
  [ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
  timeout 560 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_spec_device_loop.py \
    tests/test_quantized_matmul.py tests/test_gguf_quant.py 2>&1 | tee "$OUT/engine_gpu_tests.log" | tail -30
  ;;
esac
