# One H200 call (<= 4 min): issue 13's leftovers in the quantised paths.
#   1. GPU tests: the two W8A8 configurations that failed on the H200 (M = 333 with the swizzled epilogue, alone and
#      in clusters of 2; fixed by padding the output's rows to 8), the rest of that test class, the model door's W8A8
#      prefill on the GPU, and the one-pass activation quantiser (pallas_kernels/act_quant.py, Triton).
#   2. model.quant.matmul's W8A8 path end to end (quantiser + GEMM on the [N, K] weight) vs XLA bf16 at M = 4096 on
#      the four Llama-3-8B shapes, and the path before (per-call transpose + jnp quantiser).
#   3. 8B decode with int4_rtn weights through the streaming kernel (quantized_stream_layout now takes int4).
#   (The GPU tests include the streaming kernel's new int8 / fp8 conversion flags, upcast_load and overlap.)
#   run(command="bash benchmarks/run_quant_leftovers_gpu.sh", timeout_s=280)
set -x
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
F="grep -v ^WARNING\|Warn"
mkdir -p $OUT/tests
OUT=$OUT/tests bash benchmarks/run_gpu_tests.sh 50 \
  "tests/test_w8a8_matmul.py::TestGpu::test_matches_reference" tests/test_w8a8_matmul.py::test_quant_matmul_prefill_on_gpu \
  tests/test_act_quant.py tests/test_stream_matmul_mgpu.py::test_conversion_flags_on_gpu
timeout 70 python3 benchmarks/w8a8_matmul.py --model_path_only --out $OUT/w8a8_model_path_h200.json 2>&1 | $F | tail -12
timeout 120 python3 benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32 --repeats 3 \
  --formats int4_rtn --stream_layout --out $OUT/decode_int4_stream_llama3_8b.json 2>&1 | $F | grep "llama3_8b\|Error\|error" | tail -10
