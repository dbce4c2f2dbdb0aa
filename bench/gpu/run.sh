#!/usr/bin/env bash
# One call on a CUDA machine with no network: the CUDA tests, then `ppo-critic bench` (padded HF baseline, packed,
# megatron TP=1/PP=1) at the Qwen2.5-0.5B shape.
# Full results under ${OUT:-/tmp/ppo-critic-gpu}; a short table is printed last. Wheels the box lacks travel in
# .whl/ (bench/gpu/fetch_wheels.sh). Usage from the repo root: bash bench/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/ppo-critic-gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
timeout 150 python3 -m pytest -q -rs -k cuda tests/test_packing.py tests/test_critics_dp.py \
  tests/test_models_compile.py tests/distributed/test_megatron.py >"$out/tests.log" 2>&1
# the baseline, the packed path, then the levers of the performance issue one by one (+dyn: token-budget
# micro-batches; +fused: fused AdamW; +compile: torch.compile per decoder layer), megatron; one profiled update each
timeout 330 python3 -m ppo_critic bench \
  paths=padded,packed,packed+dyn,packed+dyn+fused,packed+dyn+fused+compile,megatron repeats=3 profile=true \
  out="$out/bench.json" >"$out/bench.log" 2>&1
echo "== tests"
grep -E "passed|failed|error" "$out/tests.log" | tail -3
echo "== ppo-critic bench: Qwen2.5-0.5B shape, bf16, 32 x (512 + 1024) rollouts, ~50 % fill"
tail -14 "$out/bench.log"
