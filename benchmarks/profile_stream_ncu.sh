# Nsight Compute on the decode matmuls (one device call, ~3 min), via benchmarks/profile_stream_ncu.py:
#   bash benchmarks/profile_stream_ncu.sh               the Mosaic streaming kernel: int8 and bf16 at 4096x14336,
#                                                       M = 1, and int8 with the upcast_load + overlap flags
#   bash benchmarks/profile_stream_ncu.sh gemv [FMT...] pallas_kernels/gemv.py (default bf16 int8 int4_g128), its
#                                                       kernel only (`-k regex:gemv`)
# prints per kernel the duration, DRAM throughput, issue-slot utilisation and top warp stall reasons. Reports and CSVs
# under $OUT (ncu_stream_<name>.* / ncu_gemv_<fmt>.*).
#   run(command="bash benchmarks/profile_stream_ncu.sh", timeout_s=300)
set -u
export PYTHONPATH=${PYTHONPATH:-.} XLA_PYTHON_CLIENT_PREALLOCATE=false
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then echo "ncu not found"; exit 1; fi
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy"
KERNELS=""  # ncu's kernel filter (empty: every kernel, XLA's fusions around the call included)
run() {  # report name, then profile_stream_ncu.py's launch arguments
  local name=$1
  shift
  timeout 80 $NCU --clock-control none $KERNELS $SECTIONS -f -o $OUT/ncu_$name \
    python3 benchmarks/profile_stream_ncu.py "$@" > $OUT/ncu_$name.log 2>&1
  echo "== $name (rc=$?): $(grep launched $OUT/ncu_$name.log)"
  $NCU --import $OUT/ncu_$name.ncu-rep --csv --page raw > $OUT/ncu_$name.csv 2>/dev/null &&
    python3 benchmarks/profile_stream_ncu.py --summarise $OUT/ncu_$name.csv
}
if [ "${1:-}" = gemv ]; then
  shift
  KERNELS="-k regex:gemv"
  for fmt in ${@:-bf16 int8 int4_g128}; do run gemv_$fmt --gemv --fmt $fmt; done
else
  run stream_int8 --fmt int8 --config ""
  run stream_bf16 --fmt bf16 --config ""
  run stream_int8_upcast_overlap --fmt int8 --config "upcast_load=True,overlap=True"
fi
