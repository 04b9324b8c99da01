# Issue 17's unmeasured figures at Llama-3-8B shape (random bf16 weights) on one H200, one device call of at most
# 6 minutes (benchmarks/perf17.py; every row's JSON line is appended to $OUT/perf17_llama3_8b.jsonl as it ends):
#   run(command="bash benchmarks/run_perf17_gpu.sh", timeout_s=420)
# 1. One process, one engine (max_num_seqs 256, max_num_batched_tokens 8192, all 28 buckets warmed up front,
#    ~70 s cold): TTFT of a 1,000-token prompt (Pallas and XLA attention, and the runner's prefill alone), the
#    per-step profile at batch 1 / 64 / 256 from profiler traces, p99 ITL at 0.8x peak Poisson load vs idle.
# 2. A second process: 8k / 16k / 32k prefill through the Pallas ragged kernel (chunked by 8192 and in one piece)
#    next to plain XLA attention over a contiguous cache ("OOM" where it runs out of memory).
# The 1,000 x (1,000 / 1,000) throughput run (round-1 flags, ~5 min) does not fit beside them; it is a second call:
#   run(command="bash benchmarks/run_perf17_gpu.sh throughput", timeout_s=330)
set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.used --format=csv
CC=/tmp/jax_cc
if [ "$1" = throughput ]; then
  # Round 1's command (BENCHMARKS.md "Engine throughput"), with the warm-up now outside the timed run: 200 s of run
  # holds the whole 1,000 requests (round 1 ran 161 s past its 70 s of lazy compiles).
  timeout 300 python3 benchmarks/throughput.py --preset llama3_8b --num_requests 1000 --input_len 1000 \
    --output_len 1000 --max_num_seqs 256 --max_num_batched_tokens 8192 --time_limit 200 \
    --compilation_cache_dir $CC --out $OUT/throughput_llama3_8b.json 2>&1 | grep -v "^WARNING\|Warn" | tail -32
  exit
fi
O=$OUT/perf17_llama3_8b.jsonl
timeout 230 python3 benchmarks/perf17.py --what ttft,profile,itl_load --time_limit 60 --duration 15 \
  --compilation_cache_dir $CC --trace_dir /tmp/perf17_trace --out $O > $OUT/perf17_engine.log 2>&1
echo "rc=$?"; grep "^perf17 " $OUT/perf17_engine.log; grep -v "^perf17 \|^{" $OUT/perf17_engine.log | tail -4
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 125 python3 benchmarks/perf17.py --what long --time_limit 100 \
  --compilation_cache_dir $CC --out $O > $OUT/perf17_long.log 2>&1
echo "rc=$?"; grep "^perf17 " $OUT/perf17_long.log; grep -v "^perf17 \|^{" $OUT/perf17_long.log | tail -4
