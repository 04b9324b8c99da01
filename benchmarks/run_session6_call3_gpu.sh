# Session 6, call 3 (one H200 call; carry .gpu_carry/a so that the next call, run_spec_loop_gpu.sh with
# .gpu_carry/b, finds half a parked in /tmp/gpuc): issue 17's perf17 rows, then issue 13's leftovers.
# As run on 2026-12-02 the leftovers had tighter limits (tests 85 s, W8A8 model path 50 s, int4 decode 85 s) than
# run_quant_leftovers_gpu.sh has since (50 / 70 / 120 s: the decode was cut after batch 1).
#   run(command="bash benchmarks/run_session6_call3_gpu.sh", carry=[".gpu_carry/a"], timeout_s=595)
bash benchmarks/run_perf17_gpu.sh
bash benchmarks/run_quant_leftovers_gpu.sh
