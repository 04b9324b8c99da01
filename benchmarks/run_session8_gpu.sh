# Session 8, call 2 on one H200 (after a call that parked .gpu_carry/a in /tmp/gpuc on the same warm machine; carry
# .gpu_carry/b now): SmolLM2 real-weight batch-1 speculation (off / ngram / ngram_device, part 1 of
# run_spec_loop_gpu.sh), then tests/test_engine_gpu.py on the real model.
#   run(command="bash benchmarks/run_session8_gpu.sh", carry=[".gpu_carry/b"], timeout_s=400)
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$OUT"
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
K="--k 4 --max_tokens 128 --methods off,ngram,ngram_device --max_num_seqs 1 --warmup pass"
timeout 150 python3 benchmarks/spec_engine.py --prompt_chars 1500 $K --prompts_per_domain 2 \
  --out $OUT/spec_loop_h200_smollm2_real.json > $OUT/spec_smol.log 2>&1
echo "spec rc=$?"; grep -v "^WARNING\|Warn" $OUT/spec_smol.log | tail -30
timeout 200 env -u XLA_PYTHON_CLIENT_MEM_FRACTION XLA_PYTHON_CLIENT_PREALLOCATE=false \
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs -n 4 tests/test_engine_gpu.py > $OUT/engine_gpu.log 2>&1
echo "engine rc=$?"; tail -15 $OUT/engine_gpu.log
