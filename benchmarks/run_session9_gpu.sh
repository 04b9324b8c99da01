# Session 9, call 2 on one H200 (after a call that parked .gpu_carry/a in /tmp/gpuc; carry .gpu_carry/b now):
# the act_quant GPU tests after the reciprocal rule, SmolLM2 real-weight batch-1 speculation (off / ngram /
# ngram_device, engine warm-up, compiles counted per timed pass), then tests/test_engine_gpu.py.
#   run(command="bash benchmarks/run_session9_gpu.sh", carry=[".gpu_carry/b"], timeout_s=590)
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 -rf tests/test_act_quant.py > $OUT/act_quant.log 2>&1
echo "act_quant rc=$?"; tail -6 $OUT/act_quant.log
timeout 290 python3 benchmarks/spec_engine.py --prompt_chars 1500 --k 4 --max_tokens 128 --max_num_seqs 1 \
  --methods off,ngram,ngram_device --warmup engine --prompts_per_domain 2 \
  --out $OUT/spec_engine_h200_smollm2_real.json > $OUT/spec_smol.log 2>&1
echo "spec rc=$?"; grep -v "^WARNING\|Warn\|^W[0-9]\|^I[0-9]" $OUT/spec_smol.log | tail -45
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rf -n 4 tests/test_engine_gpu.py > $OUT/engine_gpu.log 2>&1
echo "engine rc=$?"; tail -12 $OUT/engine_gpu.log
