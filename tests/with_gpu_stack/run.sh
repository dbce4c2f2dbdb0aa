#!/usr/bin/env bash
# Run the test suite on the software of the GPU images our users run (Python 3.12, torch 2.11's CUDA build,
# transformers 5.17, megatron-core 0.19), on CPU:
#   bash tests/with_gpu_stack/run.sh [pytest args]
# The environment (.venv-gpu-stack/, ~5.4 GB) is rebuilt only when requirements.txt or pyproject.toml change.
#
# Which tests: every module except those whose subject is pure Python and cannot differ with torch, transformers
# or megatron-core (config and option parsing, file and run-directory safety, rollout files, plots, console and
# logger output, docs). A new test module runs here unless it is added to SAME_ON_EVERY_STACK. The excluded
# test_documented_commands (docs; ~7 of the ~16 min the whole suite takes here on 2 cores) re-runs CLI paths
# that test_cli, test_train, test_throughput and tests/distributed already run in this environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-gpu-stack
reqs=tests/with_gpu_stack/requirements.txt
SAME_ON_EVERY_STACK=(
  config/test_critic config/test_reference config/test_verl config/test_env config/test_train_config  # config, options
  integrations/test_hooks  # import hooks
  run/test_files test_cli_safety run/test_rundir run/test_runlog                     # durable writes, run-directory rules
  rollout_files/test_rollout_files run/test_plots run/test_console run/test_loggers  # rollout files, outputs
  test_documented_commands test_gpu_harness test_design_doc                          # docs, bench/gpu scripts
)
stamp="$(cat "$reqs" pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  # pyenv's 3.12 (its shim answers only where 3.12 is selected), else a python3.12 on PATH
  python312=$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3 2>/dev/null | tail -1 || true)
  python312=${python312:-python3.12}
  "$python312" -m venv "$venv"
  "$venv/bin/pip" install -q -r "$reqs" -e '.[dev]'  # the pins and the project's dev extras, resolved together
  echo "$stamp" > "$venv/.stamp"
fi
ignore=()
for module in "${SAME_ON_EVERY_STACK[@]}"; do ignore+=("--ignore=tests/$module.py"); done
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${ignore[@]}" "$@"
