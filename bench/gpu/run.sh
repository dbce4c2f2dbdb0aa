#!/usr/bin/env bash
# One call on a CUDA machine with no network: the CUDA tests, then padded vs packed and megatron vs data-parallel
# at the Qwen2.5-0.5B shape.
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
timeout 300 python3 -m pytest -q -rs -k cuda tests/test_packing.py tests/test_critics_dp.py \
  tests/distributed/test_megatron.py >"$out/tests.log" 2>&1
timeout 300 python3 bench/packing.py --device cuda --dtype bfloat16 --layers 24 --hidden 896 --heads 14 \
  --kv-heads 2 --intermediate 4864 --vocab 151936 --batch 32 --prompt 512 --response 1024 --micro 8 --repeats 3 \
  --out "$out/packing.json" >"$out/packing.log" 2>&1
timeout 180 python3 bench/megatron_vs_dp.py --device cuda --dtype bfloat16 --layers 24 --hidden 896 --heads 14 \
  --kv-heads 2 --intermediate 4864 --vocab 151936 --batch 32 --prompt 512 --response 1024 --micro 8 --repeats 2 \
  --out "$out/megatron.json" >"$out/megatron.log" 2>&1
echo "== tests"
grep -E "passed|failed|error" "$out/tests.log" | tail -3
echo "== padded vs packed (bench/packing.py, bf16, Qwen2.5-0.5B shape, 32 x (512 + 1024))"
tail -4 "$out/packing.log"
echo "== megatron TP=1/PP=1 vs data-parallel packed (bench/megatron_vs_dp.py, bf16, same shape)"
tail -4 "$out/megatron.log"
