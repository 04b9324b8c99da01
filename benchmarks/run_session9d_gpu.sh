# Session 9, one H200 call, no model carried: is the dtype why real SmolLM2 speculation ran 4x slower than off
# (session 9 call 2, float32, the engine's default) while random bf16 weights at that shape ran 2-5x faster
# (session 8)? Random SmolLM2-shape weights in float32 (under cProfile, with a device trace) and in bfloat16,
# off / ngram / ngram_device; then the act_quant GPU tests after the x / scale rule and the boundary-aware check.
#   run(command="bash benchmarks/run_session9d_gpu.sh", timeout_s=420)
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 -rf tests/test_act_quant.py > $OUT/act_quant.log 2>&1
echo "act_quant rc=$?"; tail -4 $OUT/act_quant.log
# quant.reference_matmul's operands now sit behind a barrier: does the fp8 model path's 2.56% go (the oracle's)?
timeout 80 python3 benchmarks/w8a8_matmul.py --model_path_only --shapes q_o_4096x4096 --out $OUT/w8a8_model_path.json \
  > $OUT/w8a8.log 2>&1
echo "w8a8 rc=$?"; grep '^{' $OUT/w8a8.log | python3 -c "
import json, sys; [print({k: round(v, 5) for k, v in json.loads(l).items() if 'rel_error' in k}) for l in sys.stdin]"
for dt in float32 bfloat16; do
  prof=""; [ $dt = float32 ] && prof="-m cProfile -o $OUT/spec_$dt.prof"
  timeout 150 python3 $prof benchmarks/spec_engine.py --random_weights smollm2_135m --dtype $dt --k 4 \
    --max_tokens 96 --max_num_seqs 1 --methods off,ngram,ngram_device --warmup engine --prompts_per_domain 1 \
    $( [ $dt = float32 ] && echo --trace_dir /tmp/tr ) --out $OUT/spec_random_$dt.json > $OUT/spec_$dt.log 2>&1
  echo "$dt rc=$?"; grep -E "^(off|ngram|ngram_device) " $OUT/spec_$dt.log | cut -c1-900
done
[ -f $OUT/spec_float32.prof ] && python3 -c "
import pstats; p = pstats.Stats('$OUT/spec_float32.prof'); p.sort_stats('tottime').print_stats(14)" 2>&1 \
  | grep -v '^$' | cut -c1-160 | tail -18
