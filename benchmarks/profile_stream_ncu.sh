# Nsight Compute on the streaming decode matmul (one H200 call, ~3 min): int8 and bf16 at 4096x14336, M = 1 (the
# case at 1.43 vs 2.12 TB/s), and int8 with the upcast_load + overlap flags; prints per kernel the duration, DRAM
# throughput, issue-slot utilisation and top warp stall reasons (benchmarks/profile_stream_ncu.py). Reports and CSVs
# under $OUT.
#   run(command="bash benchmarks/profile_stream_ncu.sh", timeout_s=300)
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then echo "ncu not found"; exit 1; fi
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy"
run() {  # name fmt config
  timeout 80 $NCU --clock-control none $SECTIONS -f -o $OUT/ncu_stream_$1 \
    python3 benchmarks/profile_stream_ncu.py --fmt $2 --config "$3" > $OUT/ncu_stream_$1.log 2>&1
  echo "== $1 (rc=$?): $(grep launched $OUT/ncu_stream_$1.log)"
  $NCU --import $OUT/ncu_stream_$1.ncu-rep --csv --page raw > $OUT/ncu_stream_$1.csv 2>/dev/null &&
    python3 benchmarks/profile_stream_ncu.py --summarise $OUT/ncu_stream_$1.csv
}
run int8 int8 ""
run bf16 bf16 ""
run int8_upcast_overlap int8 "upcast_load=True,overlap=True"
