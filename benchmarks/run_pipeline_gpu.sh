# Pipeline-parallel serving on H200s (issue 14 item 2). Two GPUs (~4 minutes of one device call):
#   run(kind="nvidia-h200-x2", command="bash benchmarks/run_pipeline_gpu.sh", timeout_s=600)
# One GPU (PP needs a device per stage, so a correctness run only: one "stage" over m microbatches, the device
# kernels on the microbatch split, checked against the unsplit layers; ~2 minutes):
#   run(kind="nvidia-h200", command="bash benchmarks/run_pipeline_gpu.sh", timeout_s=600)
# then copy $OUT/*.json to benchmarks/results/ and add the figures to BENCHMARKS.md.
set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.used --format=csv
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -ge 2 ]; then
  # 1. The engine with the default (Pallas / Triton) kernels: SmolLM2-135M float32, 16 greedy requests of 200
  #    prompt tokens + 64 generated, one GPU vs 2 stages; tokens must be identical; tokens/s for both.
  timeout 240 python benchmarks/pipeline_engine.py --pp 2 --dtype float32 --prompts 16 --max_tokens 64 \
    --out $OUT/pipeline_engine_h200x2.json 2>&1 | grep -v "^WARNING\|Warn" | tail -6
  STAGES=2
else
  STAGES=1
fi
# 2. One pipelined pass over SmolLM2's 30 layers (bf16, default kernels): busy ticks vs m / (m + p - 1), step time
#    vs the unsplit layers on one GPU and the ideal GPipe time, max |difference| to the unsplit output; m = 1..8.
timeout 240 python benchmarks/pipeline_utilisation.py --preset smollm2_135m --dtype bfloat16 --backend default \
  --stages $STAGES --microbatches 1,2,4,8 --decode_rows 64 --prefill 8x2048 \
  --out $OUT/pipeline_utilisation_h200x${NGPU}.json 2>&1 | grep -v "^WARNING\|Warn" | tail -10
