# Session 9, call 4 on one H200 (after a call that parked .gpu_carry/a in /tmp/gpuc; carry .gpu_carry/b now): why
# real-weight SmolLM2 speculation is 4x slower than off (session 9 call 2: ~56 ms a host verify pass against 2.4 ms
# a decode token; random weights at the same shape were 2x faster than off): float32 (the engine's default dtype)
# vs bfloat16, off / ngram, under cProfile (host) with a device trace of the code requests (GPU busy vs wall).
#   run(command="bash benchmarks/run_session9c_gpu.sh", carry=[".gpu_carry/b"], timeout_s=590)
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
for dt in float32 bfloat16; do
  timeout 230 python3 -m cProfile -o $OUT/spec_$dt.prof benchmarks/spec_engine.py --prompt_chars 1500 --k 4 \
    --max_tokens 64 --max_num_seqs 1 --methods off,ngram --warmup engine --prompts_per_domain 1 --dtype $dt \
    --trace_dir /tmp/tr_$dt --out $OUT/spec_h200_real_$dt.json > $OUT/spec_$dt.log 2>&1
  echo "$dt rc=$?"; grep -v "^WARNING\|Warn\|^W[0-9]\|^I[0-9]" $OUT/spec_$dt.log | grep -v '^ ' | cut -c1-1500 | tail -8
  python3 -c "
import pstats; p = pstats.Stats('$OUT/spec_$dt.prof'); p.sort_stats('tottime').print_stats(12)
p.print_callees('speculate.py.*\(step\)'); p.print_callees('runner.py.*\(forward\)')" 2>&1 | grep -v "^$" | cut -c1-170 | tail -45
done
