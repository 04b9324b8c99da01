# Batch-1 tokens/s of n-gram speculation inside the on-device decode loop (serving/engine/spec_loop.py) against
# speculation off and the host verify path (one round trip per pass), greedy, through the engine
# (benchmarks/spec_engine.py --methods off,ngram,ngram_device), ~3-4 min on one H200 (at most 5.5, the timeouts):
#   0. tests/test_spec_device_loop.py's gpu test: greedy tokens of the loop = plain decoding's on the GPU kernels;
#   1. SmolLM2-135M-Instruct, real weights, code / prose / copy-heavy prompts: needs the default model, assembled
#      from its two carried halves as benchmarks/run_gpu_tests.sh does (half a parked in /tmp/gpuc by an earlier call
#      on the same warm machine, half b carried now). Without the model this part runs at SmolLM2 shape with random
#      weights on token-id prompts (said in the output: "model": "... random weights").
#   2. Llama-3-8B shape, random bf16 weights, token-id prompts (a repeated random block, and free ids): greedy decoding
#      of random weights falls into cycles that prompt lookup drafts; the acceptance is reported next to the speed.
# Run after a call that parked half a (e.g. bash benchmarks/run_gpu_tests.sh ... with carry [".gpu_carry/a"]):
#   run(command="bash benchmarks/run_spec_loop_gpu.sh", carry=[".gpu_carry/b"], timeout_s=330)
# or alone (random weights in part 1):
#   run(command="bash benchmarks/run_spec_loop_gpu.sh", carry=[".gpu_carry/a"], timeout_s=330)
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
mkdir -p "$OUT"
SMOL="--prompt_chars 1500"
[ -f $M ] || { echo "SmolLM2 not assembled: part 1 runs at its shape with random weights"; SMOL="--random_weights smollm2_135m"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
F="grep -v ^WARNING\|Warn"
# exactness on the GPU kernels first (tiny model: device loop vs plain decoding, greedy)
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_spec_device_loop.py 2>&1 | tail -3
# batch 1 only (--max_num_seqs 1) and compiled by the untimed first pass (--warmup pass): the engine's warm-up of
# every bucket cost SmolLM2 its whole 120 s in the first run of this script
K="--k 4 --max_tokens 128 --methods off,ngram,ngram_device --max_num_seqs 1 --warmup pass"
timeout 120 python3 benchmarks/spec_engine.py $SMOL $K --prompts_per_domain 2 \
  --out $OUT/spec_loop_h200_smollm2.json 2>&1 | $F | tail -40
timeout 150 python3 benchmarks/spec_engine.py --random_weights llama3_8b $K --prompts_per_domain 1 \
  --out $OUT/spec_loop_h200_llama3_8b.json 2>&1 | $F | tail -40
ls -la $OUT
