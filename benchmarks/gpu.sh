#!/usr/bin/env bash
# Device runs, one named case per capability; each writes its JSON / logs under $OUT and prints a summary.
#
#   bash benchmarks/gpu.sh CASE [PART]      (from the repository root, on a machine with an NVIDIA GPU)
#
#   tests [FILES...]  GPU-marked tests (default: all of tests/), 8 workers sharing the card
#   decode   [formats|int4|gemv|kv|concurrency|mixtral]      Llama-3-8B-shape decode per weight format (random weights)
#   throughput [bf16|w8a8|fp8|blocked]                      1,000 requests x 1,000 in / 1,000 out at Llama-3-8B shape
#   kernels  [flash_paged|grouped|gemv|rope|stream|w8a8|rows|paged_sweep|ncu]   kernels against their peers
#   spec     [batch1|load|medusa|random]                    speculative decoding, SmolLM2 (model carried: see below)
#   quant    [stream_layout|rows|w8a8_profile|fp8_profile|kernel_counts]  quantised weights: decode, per-row-count
#                                                           matmuls, profiles, kernels per layer (fused quantisers)
#   engine   [profile|itl|startup|idle|dispatch|phases|backends]  step profile, TTFT, ITL under load, start-up,
#                                                           GPU idle; does a step's dispatch return before the device
#                                                           runs it; host time per phase of a step (batch 1 / 64 /
#                                                           256); the same per attention backend at 4 layers,
#                                                           batch 2
#   models   [qwen3|gemma2|gpt_oss|mla]                     decode batch 1 / 64 at Qwen3-8B, Gemma-2-9B, gpt-oss-20b
#                                                           shapes (benchmarks/shapes.py); MLA kernels against XLA
#   moe      [decode|grouped|ep]                            Mixtral-shape decode and grouped matmul; expert parallelism
#   parallel                                                pipeline utilisation (and the pipelined engine on >= 2 GPUs)
#   worked                                                  the worked example at Llama-3-8B shape
#   serving  [load_bf16|load_w8a8]                          online load over HTTP: request-rate sweep, Llama-3-8B shape
#
# Without PART every part of the case runs, which may exceed one 10-minute device call: name a part per call.
# Random-weight presets (llama3_8b, mixtral_8x7b) need nothing carried. Cases that load the default model (spec, the
# engine GPU tests) need it carried: `bash benchmarks/make_gpu_carry.sh` builds .gpu_carry/{a,b,c}, carried one per
# call on one warm machine; benchmarks/gpu_model_setup.sh assembles it once all three parts are there.
# TL overrides a run's time limit in seconds where a case says so.
set -u
source benchmarks/gpu_call_prelude.sh
CC=/tmp/jax_cc  # one persistent compilation cache per machine: later runs of a case skip compiling
PROFILE=benchmarks/engine_latency.py  # the engine's step profile, TTFT, long prompts and ITL under load
LATENCY_ROW="^engine_latency "  # the summary lines it prints
CASE=${1:-help}
PART=${2:-all}
[ $# -gt 0 ] && shift
quiet() { grep -v "^WARNING\|Warning"; }
part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
need_model() { [ -f "$M" ] || { echo "the default model is not assembled: carry .gpu_carry/{a,b,c} first"; exit 3; }; }
decode() {  # $1 time limit (s), then decode_llama.py flags: Llama-3-8B shape, ctx 1024, 32-step loops, median of 3
  local limit=$1; shift
  timeout "$limit" python3 benchmarks/decode_llama.py --preset llama3_8b --ctx 1024 --steps 32 --repeats 3 \
    --compilation_cache_dir "" "$@" 2>&1 | quiet | tail -14
}

case "$CASE" in
tests)
  FILES=("$@"); [ ${#FILES[@]} -eq 0 ] && FILES=(tests)
  timeout -s INT -k 20 "${TL:-560}" python3 -m pytest -n 8 -m gpu -q --timeout 500 -rfEs -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" "${FILES[@]}" 2>&1 | quiet > "$OUT/gpu_tests.log"
  echo "rc=${PIPESTATUS[0]}"; tail -40 "$OUT/gpu_tests.log"
  ;;
decode)
  part formats && decode 300 --batches 1,64 --formats bf16,int8,fp8,int4_rtn --out "$OUT/decode_formats.json"
  part int4 && decode 300 --batches 64,256 --formats bf16,int4_rtn --out "$OUT/decode_int4.json"
  part gemv && decode 400 --batches 1 --formats bf16,int4_rtn,int8,fp8 --paths default,no_gemv \
    --trace_dir /tmp/traces --out "$OUT/decode_gemv.json"
  part kv && decode 330 --batches 1,64 --formats bf16 --kv_cache_dtypes auto,int8 --out "$OUT/decode_kv.json"
  part concurrency && timeout 60 python3 benchmarks/decode_llama.py --preset llama3_8b --batches "" \
    --formats bf16,int4_rtn --kv_cache_dtypes auto,int8 --out "$OUT/concurrency.json" 2>&1 | quiet | tail -6
  part mixtral && timeout 150 python3 benchmarks/decode_llama.py --preset mixtral_8x7b --batches 1,64 --ctx 1024 \
    --steps 16 --repeats 3 --out "$OUT/decode_mixtral_8x7b.json" 2>&1 | quiet | tail -6
  ;;
throughput)
  run_tp() {  # $1 name, then throughput.py flags
    local name=$1; shift
    timeout $((${TL:-200} + 200)) python3 benchmarks/throughput.py --preset llama3_8b --time_limit "${TL:-200}" \
      --compilation_cache_dir $CC --out "$OUT/throughput_$name.json" "$@" 2>&1 | quiet | tail -20
  }
  part bf16 && run_tp llama3_8b_bf16
  part w8a8 && run_tp w8a8_fp8_rtn_int8kv --quantization w8a8_fp8_rtn --kv_cache_dtype int8
  part fp8 && run_tp fp8_stream_fp8kv --quantization fp8 --stream_layout --kv_cache_dtype fp8
  if part blocked; then
    for rule in on off; do run_tp "blocked_$rule" --loop_while_blocked $rule; done
  fi
  ;;
kernels)
  part flash_paged && timeout 560 python3 benchmarks/kernels.py --out_dir "$OUT" --quick 2>&1 | quiet | tail -40
  part grouped && timeout 120 python3 benchmarks/grouped_matmul.py --moe_block_tokens 4096 \
    --out "$OUT/grouped_matmul.json" 2>&1 | quiet | tail -16
  part gemv && timeout 400 python3 benchmarks/gemv.py --sweep --budget_s 250 --rows 1 \
    --formats bf16,int8,fp8,int4_g128,int4_g32_asym,int8_g32 \
    --shapes 4096x6144,4096x1024,4096x28672,14336x4096,4096x14336 --out "$OUT/gemv_sweep.json" 2>&1 \
    | quiet | grep -v "^sweep"
  part rope && timeout 120 python3 benchmarks/rope_kv_write.py --out "$OUT/rope_kv_write.json" 2>&1 | quiet
  part stream && timeout 320 python3 benchmarks/stream_matmul_mgpu.py --budget_s 290 --out "$OUT/stream_matmul.json" \
    2>&1 | quiet | grep -v "^check" | tail -40
  part w8a8 && timeout 150 python3 benchmarks/w8a8_matmul.py --sweep_seconds 20 --out "$OUT/w8a8_matmul.json" 2>&1 \
    | quiet | tail -30
  part rows && timeout 270 python3 benchmarks/matmul_rows.py --shapes 4096x28672,4096x6144 \
    --rows 1,64,256,512,2048,8192 --paths bf16,engine,xla_dequant,stream,w8a8 --budget_s 230 \
    --out "$OUT/matmul_rows.json" 2>&1 | grep "^matmul_rows"
  part paged_sweep && timeout 280 python3 benchmarks/paged_decode_sweep.py --budget_s 230 \
    --out "$OUT/paged_decode_sweep.json" 2>&1 | grep "^paged_decode_sweep" | cut -c1-300
  part ncu && bash benchmarks/profile_stream_ncu.sh gemv ${NCU_FORMATS:-bf16 int8 int4_g128}
  ;;
spec)
  if part batch1; then
    need_model
    timeout 200 python3 benchmarks/spec_engine.py --prompt_chars 1500 --k 3 --max_tokens 128 --max_num_seqs 1 \
      --methods off,ngram_device,self_device,draft_device --self_layers 20 --draft_layers 20 --warmup engine \
      --prompts_per_domain 2 --dtype bfloat16 --out "$OUT/spec_engine_batch1.json" 2>&1 | quiet \
      | grep -E "^(off|ngram_device|self_device|draft_device) " | cut -c1-400
  fi
  if part load; then
    need_model
    timeout 420 python3 benchmarks/spec_load.py --preset smollm2 --rates 3,8,16,128 --num_requests 256 \
      --max_tokens 120 --max_num_seqs 32 --memory_budget_gb 4 --spec_batch_threshold 8 --warmup serve \
      --out "$OUT/spec_load.json" 2>&1 | grep -E '^\{' | cut -c1-400
  fi
  if part medusa; then  # train heads on the card's own generations, then time them at batch 1
    need_model
    C=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    timeout 330 python3 -m serving.train_heads --model "$M" --corpus "$C/*.py" --out_dir "$OUT/heads" \
      --num_prompts 2048 --prompt_len 128 --max_tokens 128 --steps 4000 --lr 2e-3 --batch_positions 512 \
      --max_num_seqs 256 --dtype bfloat16 2>&1 | grep -E "^(generated|held-out|wrote|[A-Za-z]*Error)"
    timeout 200 python3 benchmarks/spec_engine.py --prompt_chars 1500 --k 3 --max_tokens 128 --max_num_seqs 1 \
      --methods off,medusa_device --medusa_heads "$OUT/heads" --warmup engine --prompts_per_domain 2 \
      --dtype bfloat16 --out "$OUT/spec_engine_medusa.json" 2>&1 | grep -E "^(off|medusa_device) " | cut -c1-600
  fi
  if part random; then  # no model needed: SmolLM2's shape with random weights, float32 and bf16
    for dt in float32 bfloat16; do
      timeout 150 python3 benchmarks/spec_engine.py --random_weights smollm2_135m --dtype $dt --k 4 --max_tokens 96 \
        --max_num_seqs 1 --methods off,ngram,ngram_device --warmup engine --prompts_per_domain 1 \
        --out "$OUT/spec_random_$dt.json" 2>&1 | grep -E "^(off|ngram|ngram_device) " | cut -c1-600
    done
  fi
  ;;
quant)
  part stream_layout && decode 400 --batches 1,64 --formats int8,fp8,int4_rtn --stream_layout \
    --out "$OUT/decode_stream_layout.json"
  part rows && bash "$0" kernels rows
  part w8a8_profile && timeout 330 python3 $PROFILE --what profile --batches 64,256 --quantization w8a8_fp8_rtn \
    --kv_cache_dtype int8 --compilation_cache_dir $CC --trace_dir /tmp/profile_w8a8 --out "$OUT/profile_w8a8.jsonl" \
    2>&1 | grep -E "${LATENCY_ROW}profile batch" | cut -c1-600
  part fp8_profile && timeout 300 python3 $PROFILE --what profile --quantization fp8 --stream_layout \
    --kv_cache_dtype fp8 --compilation_cache_dir $CC --trace_dir /tmp/profile_fp8 --out "$OUT/profile_fp8.jsonl" \
    2>&1 | grep -E "${LATENCY_ROW}profile batch" | cut -c1-600
  if part kernel_counts; then  # W8A8 decode at batch 64: per layer, the input quantisers fused and not
    for src in hlo trace; do
      timeout 200 python3 benchmarks/kernel_counts.py --preset llama3_8b --quantization w8a8_fp8_rtn --batch 64 \
        --ctx 1024 --source $src --out "$OUT/kernel_counts_$src.json" 2>&1 | grep -E "^kernel_counts|Error" | cut -c1-900
    done
  fi
  ;;
engine)
  part profile && timeout 300 python3 $PROFILE --what profile,ttft --ttft_backends pallas --compilation_cache_dir $CC \
    --trace_dir /tmp/profile_trace --out "$OUT/profile.jsonl" 2>&1 | grep -E "$LATENCY_ROW" | cut -c1-400
  if part itl; then
    timeout 200 python3 $PROFILE --what itl_load --duration 15 --compilation_cache_dir $CC \
      --out "$OUT/itl_load.jsonl" 2>&1 | grep -E "${LATENCY_ROW}itl_load at"
    timeout 200 python3 $PROFILE --what itl_load --duration 15 --max_prefill_tokens_while_decoding 512 \
      --compilation_cache_dir $CC --out "$OUT/itl_load.jsonl" 2>&1 | grep -E "${LATENCY_ROW}itl_load at"
  fi
  if part startup; then  # twice: the first with an empty persistent cache, the second warm
    rm -rf /tmp/engine_core_cc
    for run in cold warm; do
      echo "start-up, $run cache:"
      timeout 250 python3 benchmarks/engine_core.py --what startup --cache_dir /tmp/engine_core_cc \
        --out "$OUT/engine_core.jsonl" 2>&1 | quiet | tail -3
    done
  fi
  part dispatch && timeout 200 python3 benchmarks/dispatch_probe.py --out "$OUT/dispatch_probe.jsonl" 2>&1 | quiet | tail -8
  part phases && timeout 400 python3 benchmarks/engine_host_phases.py --preset llama3_8b --batches 1,64,256 \
    --modes sync1,async1,async8 --compilation_cache_dir $CC --out "$OUT/engine_host_phases.jsonl" 2>&1 | quiet | tail -12
  part backends && timeout 300 python3 benchmarks/engine_host_phases.py --preset llama3_8b --num_layers 4 --batches 2 \
    --modes sync1,async1 --attention_backends mosaic_gpu,triton,xla --compilation_cache_dir $CC \
    --out "$OUT/engine_host_phases_backends.jsonl" 2>&1 | quiet | grep "^{" | cut -c1-600
  if part idle; then  # GPU idle between decode loops at batch 64, then stream delivery per decode_steps
    for what in idle itl; do
      timeout 200 python3 benchmarks/engine_core.py --what $what --out "$OUT/engine_core.jsonl" 2>&1 | quiet | tail -8
    done
  fi
  ;;
models)
  part qwen3 && decode 280 --preset qwen3_8b --batches 1,64 --out "$OUT/decode_qwen3_8b.json"
  part gemma2 && decode 280 --preset gemma2_9b --batches 1,64 --out "$OUT/decode_gemma2_9b.json"
  part gpt_oss && decode 280 --preset gpt_oss_20b --batches 1,64 --out "$OUT/decode_gpt_oss_20b.json"
  part mla && timeout 200 python3 benchmarks/kernels_mla.py --out "$OUT/kernels_mla.json" 2>&1 | quiet | tail -10
  ;;
moe)
  part decode && bash "$0" decode mixtral
  part grouped && bash "$0" kernels grouped
  if part ep; then
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "moe ep: needs 2 GPUs"; exit 0; }
    timeout 200 python3 benchmarks/moe_ep.py --ep 2 --tokens 16,256,2048 --out "$OUT/moe_ep.json" 2>&1 | quiet | tail -8
  fi
  ;;
parallel)
  NGPU=$(nvidia-smi -L | wc -l)
  if [ "$NGPU" -ge 2 ]; then
    timeout 240 python3 benchmarks/pipeline_engine.py --pp 2 --dtype float32 --prompts 16 --max_tokens 64 \
      --out "$OUT/pipeline_engine.json" 2>&1 | quiet | tail -6
  fi
  timeout 240 python3 benchmarks/pipeline_utilisation.py --preset smollm2_135m --dtype bfloat16 --backend default \
    --stages "$([ "$NGPU" -ge 2 ] && echo 2 || echo 1)" --microbatches 1,2,4,8 --decode_rows 64 --prefill 8x2048 \
    --out "$OUT/pipeline_utilisation.json" 2>&1 | quiet | tail -10
  ;;
worked)
  timeout 560 python3 benchmarks/worked_example.py --preset llama3_8b --dtype bfloat16 --replay_acceptance "${ACC:-0.873}" \
    --num_requests 48 --rate 6 --max_tokens 120 --prompt_tokens 64 192 --memory_budget_gb 15.3 --max_num_seqs 16 \
    --max_num_batched_tokens 256 --num_speculative_tokens 4 --spec_batch_threshold 8 --quality_seqs 0 \
    --compilation_cache_dir $CC --out "$OUT/worked_example.json" 2>&1 | quiet | tail -12
  ;;
serving)
  load() {  # $1 name, $2 engine options (JSON): ShareGPT-like lengths, Poisson arrivals, the engine's own defaults
    timeout "${TL:-560}" python3 benchmarks/serving_load.py --random_weights llama3_8b --rates "${RATES:-4,8,16,32}" \
      --num_requests "${NREQ:-200}" --engine_options "$2" --out "$OUT/serving_load_llama3_8b_$1.json" 2>&1 \
      | grep -E "^serving_load|^wrote|Error" | cut -c1-400
  }
  part load_bf16 && load bf16 '{"compilation_cache_dir": "/tmp/jax_cc"}'
  part load_w8a8 && load w8a8_fp8_int8kv \
    '{"quantization": "w8a8_fp8_rtn", "kv_cache_dtype": "int8", "compilation_cache_dir": "/tmp/jax_cc"}'
  ;;
*)
  sed -n '2,/^set -u/p' "$0" | sed '$d' | cut -c3-
  [ "$CASE" = help ] || exit 2
  ;;
esac
