#!/usr/bin/env bash
# Run HERE (with network) before a GPU call: puts the cp312 wheels the GPU box lacks into .whl/ (git-ignored),
# to be carried with `carry: [".whl"]`. The box has torch, transformers, pytest, hypothesis, pyarrow, ...
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl tensordict==0.15.3 pyvers omegaconf antlr4-python3-runtime==4.9.3 megatron-core==0.16.1
ls -la .whl
