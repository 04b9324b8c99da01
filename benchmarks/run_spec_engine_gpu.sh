# One H200 call (~9 min) after benchmarks/run_quant_moe_gpu.sh parked half a of the default model: the engine's GPU
# tests (half b completes the model), then issue 12's figures: batch-1 speculation on SmolLM2 per proposer with a
# profile of each method's passes (GPU busy vs wall), and the load trade at Llama-3-8B shape (replay proposer).
#   run(command="bash benchmarks/run_spec_engine_gpu.sh", carry=[".gpu_carry/b"], timeout_s=600)
set -x
bash benchmarks/run_gpu_tests.sh 150 tests/test_engine_gpu.py
export PYTHONPATH=/tmp/site:$PWD PALLAS_SERVE_CACHE=/tmp/psc XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
F="grep -v ^WARNING\|Warn"
timeout 180 python3 benchmarks/spec_engine.py --max_tokens 128 --prompts_per_domain 2 --prompt_chars 1500 --k 3 \
  --methods off,ngram,medusa --medusa_heads benchmarks/results/medusa_heads_smollm2 --trace_dir /tmp/spec_trace \
  --out $OUT/spec_engine_h200_smollm2.json 2>&1 | $F | tail -14
timeout 240 python3 benchmarks/spec_load.py --preset llama3_8b --replay_acceptance 0.7 --rates 4,64 --warmup engine \
  --num_requests 48 --max_num_seqs 64 --memory_budget_gb 60 --spec_batch_threshold 16 \
  --out $OUT/spec_load_h200_llama3_8b.json 2>&1 | $F | tail -14
