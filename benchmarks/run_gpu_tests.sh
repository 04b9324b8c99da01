# GPU-marked tests on the device machine, as `make test-gpu` runs them, for hosts without the set-up's .venv (the
# device image has jax/flax; `gguf` comes as a wheel under .gpu_carry/). Usage: bash benchmarks/run_gpu_tests.sh
# <seconds> <test files...>; writes a JUnit XML and the log under $OUT. The default model (98 MB, over what one device
# call may carry beside the tree) arrives xz-compressed in three parts over three calls (benchmarks/make_gpu_carry.sh
# builds them; benchmarks/gpu_model_setup.sh parks them in /tmp/gpuc and assembles the file, sha256 checked).
set -u
source benchmarks/gpu_model_setup.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ ! -f $M ] && [ -f /tmp/gpuc/part_ab ]; then
  cat /tmp/gpuc/part_aa /tmp/gpuc/part_ab > $M
  [ "$(sha256sum $M | cut -d' ' -f1)" = "$(cut -d' ' -f1 /tmp/gpuc/sha256)" ] && echo "model sha256 ok" || { echo "model sha256 BAD"; rm $M; }
fi
LIMIT=$1; shift  # SIGINT at the limit: pytest still prints the failures it has seen
timeout -s INT -k 20 $LIMIT python3 -m pytest -n 8 -m gpu -q --timeout 500 -rfEs --junitxml=$OUT/junit.xml \
  --continue-on-collection-errors -p no:cacheprovider "$@" 2>&1 | grep -v "PytestBenchmarkWarning\|warner(" > $OUT/log.txt
echo "rc=${PIPESTATUS[0]}"; tail -40 $OUT/log.txt
