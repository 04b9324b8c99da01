# W8A8 prefill matmul (issue 13 item 1) on one H200; each form fits one device call of under 3 minutes:
#   run(kind="nvidia-h200", command="bash benchmarks/run_w8a8_gpu.sh", timeout_s=240)
#       benchmarks/w8a8_matmul.py: every kernel row checked against reference() first, then TFLOP/s at M = 4096 on
#       the Llama-3-8B layer shapes for ours fp8 / int8, XLA bf16 / fp8 / int8 and torch _scaled_mm / _int_mm, then
#       a config sweep bounded by --sweep_seconds. Writes $OUT/w8a8_matmul_h200.json (rewritten after each shape).
#   run(kind="nvidia-h200", command="bash benchmarks/run_w8a8_gpu.sh tests", timeout_s=240)
#       the GPU-marked tests of tests/test_w8a8_matmul.py (odd shapes, every config family, the Llama shapes at
#       M = 4000, model/quant.py's W8A8 path); log and JUnit XML under $OUT.
# Copy $OUT/w8a8_matmul_h200.json to benchmarks/results/ and add the table to BENCHMARKS.md.
set -x
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch shares the GPU with JAX in the same process
nvidia-smi --query-gpu=name,memory.used --format=csv
if [ "$1" = "tests" ]; then
  timeout 170 python3 -m pytest -q -m gpu -rfEs -p no:cacheprovider --junitxml=$OUT/w8a8_junit.xml \
    tests/test_w8a8_matmul.py 2>&1 | grep -v "PytestBenchmarkWarning\|warner(" > $OUT/w8a8_gpu_tests.txt
  echo "pytest rc=${PIPESTATUS[0]}"; tail -30 $OUT/w8a8_gpu_tests.txt
else
  timeout 170 python3 benchmarks/w8a8_matmul.py --sweep_seconds 40 --out $OUT/w8a8_matmul_h200.json 2>&1 \
    | grep -v "^WARNING\|Warn" | tail -40
fi
