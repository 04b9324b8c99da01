#!/usr/bin/env bash
# Session 13's device calls (issues 13 / 17: the GEMV decode kernel). One argument picks the call:
#   gemv    GPU tests of pallas_kernels/gemv.py, then benchmarks/gemv.py (config sweep at M = 1, then the table)  [ran, H100]
#   engine  the engine GPU tests (session 12's leftover; the GEMV now serves one-row decode) and the tensor-core
#           streaming kernel's tests with bit_convert                                                        [ran, H100]
#   gemv2   the sweep of the loop mode (GemvConfig.depth) and small unrolled programs, every format; best configs
#           kept in /tmp for `decode`                                                                  [not run: no machine]
#   decode  Llama-3-8B shape, random weights, batch-1 decode per weight format, the GEMV on and off in one run
#   final   the short form of gemv2 + decode that fit session 13's last budget                        [not run: no machine]
# Next session, on an H200: gemv2 then decode on the same warm machine (~10 + ~10 min).
# The default model arrived in two halves then; since session 14 it comes in three parts (benchmarks/make_gpu_carry.sh):
# calls carrying .gpu_carry/a and .gpu_carry/b park theirs, `engine` carries .gpu_carry/c on the same warm machine.
source benchmarks/gpu_call_prelude.sh
case "$1" in
gemv)
  timeout 130 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/test_gemv.py 2>&1 | tee "$OUT/gemv_gpu_tests.log" | tail -25
  timeout 300 python3 benchmarks/gemv.py --sweep --budget_s 140 --rows 1 --shapes 4096x6144,4096x4096,4096x28672,14336x4096,4096x14336 \
    --out "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log"
  timeout 140 python3 benchmarks/gemv.py --rows 64 --formats int8,int4_g128,int4_g32_asym --shapes 4096x14336,14336x4096 \
    --out "$OUT/qmm_bits_m64.json" 2>&1 | tee "$OUT/qmm_bits_m64.log"
  ;;
gemv2)  # the second sweep (small unrolled programs, loops with tiles in flight); its best configs stay in /tmp
  timeout 330 python3 benchmarks/gemv.py --sweep --budget_s 230 --rows 1 --formats bf16,int8,int4_g128,fp8,int4_g32_asym \
    --shapes 4096x6144,4096x4096,4096x28672,14336x4096 --out "$OUT/gemv2.json" 2>&1 | tee "$OUT/gemv2.log" | grep -v "^sweep"
  cp "$OUT/gemv2.json" /tmp/gemv_best.json
  ;;
decode)  # after gemv2 on the same warm machine (its configs), else the defaults
  CONFIGS=""; [ -f /tmp/gemv_best.json ] && CONFIGS="--gemv_configs /tmp/gemv_best.json"
  timeout 560 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1 --ctx 1024 --steps 32 --repeats 3 \
    --formats ${FORMATS:-bf16,int4_rtn,int8,fp8} --gemv on,off $CONFIGS --compilation_cache_dir "" \
    --out "$OUT/decode_gemv.json" 2>&1 | tee "$OUT/decode_gemv.log" | grep -v Warning
  ;;
engine)
  [ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
  timeout 560 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_spec_device_loop.py \
    tests/test_quantized_matmul.py 2>&1 | tee "$OUT/engine_gpu_tests.log" | tail -30
  ;;
final)  # the budget's last call: a short second sweep on the big shape, then batch-1 decode with its configs
  timeout 50 python3 benchmarks/gemv.py --sweep --budget_s 28 --rows 1 --formats bf16 \
    --shapes 4096x14336 --out "$OUT/gemv2.json" 2>&1 | tee "$OUT/gemv2.log" | grep -v "^sweep"
  timeout 130 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1 --ctx 1024 --steps 32 --repeats 3 \
    --formats bf16 --gemv on,off --gemv_configs "$OUT/gemv2.json" --compilation_cache_dir "" \
    --out "$OUT/decode_gemv.json" 2>&1 | tee "$OUT/decode_gemv.log" | grep -v Warning
  ;;
esac
