# Session 10 on one H200, two calls on one warm machine (the default model arrives in two halves, see
# benchmarks/gpu_model_setup.sh):
#   run(command="bash benchmarks/run_session10_gpu.sh a", carry=[".gpu_carry/a"], timeout_s=420)
#     parks half a; the ragged kernel's small tile against verify rows (benchmarks/ragged_verify_tile.py).
#   run(command="bash benchmarks/run_session10_gpu.sh b", carry=[".gpu_carry/b"], timeout_s=590)
#     Medusa heads trained on the H200 by self-distillation (2,048 stdlib windows, 128 + 128 tokens, 4,000 steps),
#     then batch-1 speculation with them on real SmolLM2 in bf16 (off / medusa, the host verify path).
#   Later, with the heads drafting inside the on-device loop (serving/engine/spec_loop.py):
#   run(command="bash benchmarks/run_session10_gpu.sh c", carry=[".gpu_carry/a"], timeout_s=300)
#     parks half a; the GPU tests of the engine and of the device loop.
#   run(command="bash benchmarks/run_session10_gpu.sh d", carry=[".gpu_carry/b"], timeout_s=590)
#     the same training as b (heads tarred into $OUT), then off / medusa_device on real SmolLM2 in bf16.
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
if [ "$1" = a ]; then
  timeout 200 python3 benchmarks/ragged_verify_tile.py --dtypes bfloat16 --batches 1,16,64 \
    --out $OUT/ragged_verify_tile_h200_bf16.json > $OUT/rvt_bf16.log 2>&1
  echo "rvt bf16 rc=$?"
  timeout 60 python3 benchmarks/ragged_verify_tile.py --dtypes float32 --shapes smollm2_135m --batches 1 \
    --q_lens 1,5 --small_rows 16,32 --out $OUT/ragged_verify_tile_h200_f32.json > $OUT/rvt_f32.log 2>&1
  echo "rvt f32 rc=$?"
  cat $OUT/rvt_bf16.log $OUT/rvt_f32.log | grep '^{' | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r['shape'], r['dtype'], 'B', r['batch'], 'q', r['q_len'], 'rows', r['small_q_rows'], 'small' if r['small_tile'] else 'big', r['time_us'], r['vs_16'], '%.1e' % r['rel_err'])"
  exit 0
fi
if [ "$1" = c ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu -rf tests/test_engine_gpu.py \
    tests/test_spec_device_loop.py > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; tail -4 $OUT/gpu_tests.log
  exit 0
fi
[ -f $M ] || { echo "SmolLM2 not assembled: stopping"; exit 3; }
[ "$1" = d ] && DT="--dtype bfloat16" || DT=""
C=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
timeout 330 python3 -m serving.train_heads --model $M --corpus "$C/*.py" --out_dir $OUT/heads --num_prompts 2048 \
  --prompt_len 128 --max_tokens 128 --steps 4000 --lr 2e-3 --batch_positions 512 --max_num_seqs 256 $DT \
  > $OUT/train.log 2>&1
echo "train rc=$?"; grep -E "^(generated|step|held-out|wrote|\{|[A-Za-z]*Error)" $OUT/train.log | cut -c1-300
[ "$1" = d ] && tar czf $OUT/heads.tgz -C $OUT heads && METHODS=off,medusa_device || METHODS=off,medusa
timeout 200 python3 benchmarks/spec_engine.py --prompt_chars 1500 --k 3 --max_tokens 128 --max_num_seqs 1 \
  --methods $METHODS --medusa_heads $OUT/heads --warmup engine --prompts_per_domain 2 --dtype bfloat16 \
  --out $OUT/spec_engine_h200_smollm2_medusa_$1_bf16.json > $OUT/spec_medusa.log 2>&1
echo "spec rc=$?"; grep -E "^(off|medusa|medusa_device) " $OUT/spec_medusa.log | cut -c1-600; tail -2 $OUT/spec_medusa.log | cut -c1-300
