set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.used --format=csv
rm -rf /tmp/xc
O=$OUT/engine_core.jsonl
timeout 200 python benchmarks/engine_core.py --what startup --cache_dir /tmp/xc --out $O 2>&1 | grep -v "^WARNING\|Warn" | tail -3
timeout 60 python benchmarks/engine_core.py --what startup --cache_dir /tmp/xc --out $O 2>&1 | grep -v "^WARNING\|Warn" | tail -3
timeout 150 python benchmarks/engine_core.py --what idle --cache_dir /tmp/xc --out $O 2>&1 | grep -v "^WARNING\|Warn" | tail -3
timeout 60 python benchmarks/step_vs_pool.py --dtype bfloat16 --out_dir $OUT 2>&1 | tail -4
timeout 120 python benchmarks/engine_core.py --what itl --cache_dir /tmp/xc --out $O 2>&1 | grep -v "^WARNING\|Warn" | tail -5
timeout 150 python benchmarks/engine_core.py --what trace --trace_dir /tmp/ec_trace --cache_dir /tmp/xc --out $O 2>&1 | grep -v "^WARNING\|Warn" | tail -2
