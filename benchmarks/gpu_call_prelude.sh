# Sourced first by benchmarks/gpu.sh: pipefail, the carried model parts
# and the gguf wheel (benchmarks/gpu_model_setup.sh), unbuffered output, $OUT, then the card's name and clocks.
set -o pipefail
source benchmarks/gpu_model_setup.sh
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv
