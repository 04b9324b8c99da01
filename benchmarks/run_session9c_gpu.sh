# Real SmolLM2 batch-1 speculation in bfloat16 (session 9 found float32, the engine's default dtype, to be why
# speculation lost: the ragged kernel's 128-row prefill tile in f32 took ~1.3 ms a layer for a 5-token verify row),
# then the GPU tests of the W8A8 matmul file (the fp8 fake-quantisation barrier). Needs a parking call first:
#   run(command="mkdir -p /tmp/gpuc && cp .gpu_carry/a/* /tmp/gpuc/", carry=[".gpu_carry/a"])
#   run(command="bash benchmarks/run_session9c_gpu.sh", carry=[".gpu_carry/b"], timeout_s=420)
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
timeout 240 python3 benchmarks/spec_engine.py --prompt_chars 1500 --k 4 --max_tokens 128 --max_num_seqs 1 \
  --methods off,ngram,ngram_device --warmup engine --prompts_per_domain 2 --dtype bfloat16 \
  --out $OUT/spec_engine_h200_smollm2_real_bf16.json > $OUT/spec_bf16.log 2>&1
echo "spec rc=$?"; grep -E "^(off|ngram|ngram_device) " $OUT/spec_bf16.log | cut -c1-600
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 2 -rf tests/test_w8a8_matmul.py \
  -k "fake_quantized or prefill_on_gpu" > $OUT/w8a8_gpu.log 2>&1
echo "w8a8 tests rc=$?"; tail -4 $OUT/w8a8_gpu.log
