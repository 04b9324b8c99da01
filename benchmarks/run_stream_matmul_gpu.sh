# H200, <= 4 minutes: the Mosaic GPU streaming matmul (issue 13 item 1) beside Triton, XLA bf16 and cuBLAS.
#   bash benchmarks/run_stream_matmul_gpu.sh            (writes $OUT/stream_matmul_mgpu.json and .log)
# The benchmark checks correctness first, dumps its JSON after every case and stops its stages at --budget_s;
# `timeout` is the hard stop. GPU tests (a few minutes more): python -m pytest -q -m gpu tests/test_stream_matmul_mgpu.py
set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 235 python benchmarks/stream_matmul_mgpu.py --budget_s 200 --out "$OUT/stream_matmul_mgpu.json" 2>&1 \
  | grep -v "^WARNING" | tee "$OUT/stream_matmul_mgpu.log" | tail -60
