# One H200 call (~9 min): the GPU tests of issue 13's Mosaic GPU kernels (streaming decode matmul, W8A8 GEMM, grouped
# matmul), then the streaming kernel's config sweep on the two largest 8B layer shapes (no peers: they are in the
# session-5 JSON), every timed config checked against the reference first.
#   run(command="bash benchmarks/run_kernels_sweep_gpu.sh", timeout_s=600)
set -x
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
F="grep -v ^WARNING\|Warn"
mkdir -p $OUT/tests
OUT=$OUT/tests bash benchmarks/run_gpu_tests.sh 230 tests/test_stream_matmul_mgpu.py tests/test_w8a8_matmul.py \
  tests/test_grouped_matmul.py
timeout 320 python3 benchmarks/stream_matmul_mgpu.py --budget_s 290 --skip_peers --formats bf16,int8,fp8,int4_g128 \
  --shapes 4096x14336,14336x4096 --out $OUT/stream_matmul_sweep_h200.json 2>&1 | $F | grep -v "^check" | tail -40
