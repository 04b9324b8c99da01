# One H200 call (~9 min): the first GPU run of the two Mosaic GPU kernels of issue 13, each benchmark checking every
# timed kernel against reference() first: the swap-AB streaming decode matmul (TB/s per format beside the Triton
# kernel, XLA and cuBLAS), the 8B decode per format through it (--stream_layout), then the W8A8 prefill GEMM
# (TFLOP/s beside XLA and torch _scaled_mm / _int_mm). Each JSON is rewritten as it goes.
#   run(command="bash benchmarks/run_quant_kernels_gpu.sh", timeout_s=560)
set -x
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
F="grep -v ^WARNING\|Warn"
timeout 190 python3 benchmarks/stream_matmul_mgpu.py --budget_s 160 --out $OUT/stream_matmul_mgpu_h200.json 2>&1 | $F | tail -45
timeout 150 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32 --repeats 3 \
  --formats int8,fp8,int4_rtn --stream_layout --out $OUT/decode_formats_stream_llama3_8b.json 2>&1 | $F | grep "llama3_8b\|Error\|error" | tail -10
timeout 140 python3 benchmarks/w8a8_matmul.py --sweep_seconds 20 --out $OUT/w8a8_matmul_h200.json 2>&1 | $F | tail -30
