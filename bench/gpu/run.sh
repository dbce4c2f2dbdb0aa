#!/usr/bin/env bash
# One call on the GPU box (no network), from the repo root with .whl/ carried (bash bench/gpu/fetch_wheels.sh fills
# it here):
#   bash bench/gpu/run.sh                                     # the steps below, < 8 min; the table is printed last
#   bash bench/gpu/run.sh --dry-run [--allow-missing-wheels]  # here, in seconds: every step's command line parses,
#                                                             # and the wheels still missing from .whl/ are named
#   bash bench/gpu/run.sh --steps bench,verl                  # only these steps (env always runs: it installs)
# Steps, each isolated (a failing step never stops the others) and time-boxed; the boxes, and each step's estimated
# cost on the H200 beside them, are bench/gpu/harness.py's STEPS (printed first: `python3 bench/gpu/harness.py plan`):
#   env      GPU name/memory/driver, torch/transformers/triton versions, flash-attn; installs the carried wheels
#   tests    every test marked @pytest.mark.cuda, in the files under tests/ that hold one (grep, at run time)
#   train    the main job on CUDA: ppo-critic train, 50 steps
#   bench    ppo-critic bench: the lever matrix at the Qwen2.5-0.5B shape (bf16, 32 x (512 + 1024), ~50 % fill)
#   compile  ppo-critic bench of packed+dyn+fused+compile at that shape: its cold torch.compile in a box of its own
#   verl     the verl 0.9.1 engine suite's CUDA tests (tests/with_verl/engine, -m cuda)
# Options appended to a step's command: TESTS_EXTRA, TRAIN_EXTRA, BENCH_EXTRA, COMPILE_EXTRA, VERL_EXTRA (e.g.
# BENCH_EXTRA=repeats=5). Logs: ${OUT:-/tmp/ppo-critic-gpu}/ (at most 8 files, what a device call brings back:
# env.log, tests.log, train.log, bench.log (the compile step's too), bench.json, compile.json, verl.log,
# summary.txt); scratch (installed wheels, the run directory): ${WORK:-/tmp/ppo-critic-gpu-work}. Exit status: 0
# when every step is ok (or skipped).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
root=$PWD
all_steps=env,tests,train,bench,compile,verl
usage="usage: bash bench/gpu/run.sh [--dry-run] [--allow-missing-wheels] [--steps $all_steps]"
dry=0
allow_missing=0
steps=$all_steps
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --allow-missing-wheels) allow_missing=1 ;;
    --steps) steps=${2:?$usage}; shift ;;
    --steps=*) steps=${1#--steps=} ;;
    -h | --help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
for s in ${steps//,/ }; do
  case ",$all_steps," in *",$s,"*) ;; *) echo "unknown step '$s'; $usage" >&2; exit 2 ;; esac
done
[ "$dry" = 1 ] || steps="env,$steps"  # env installs what the other steps import

out=${OUT:-/tmp/ppo-critic-gpu}
work=${WORK:-/tmp/ppo-critic-gpu-work}
py=${PYTHON:-python3}  # the box's python3 holds torch
[ "$dry" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && py=.venv/bin/python  # here: the project's venv
harness=bench/gpu/harness.py
wheels=${WHEELS:-.whl}  # the carried wheels (another folder: for tests)
mkdir -p "$out" "$work"
rows="$work/rows.tsv"
: >"$rows"
export PYTHONUNBUFFERED=1

# the time boxes in seconds (T_ENV ... T_VERL), DEADLINE (their sum) and KILL_GRACE, from harness.py's STEPS: whatever
# a step overran (a kill KILL_GRACE s after the SIGINT), no box reaches past DEADLINE, so the run ends before 8 minutes
boxes=$("$py" "$harness" boxes) || exit 2
eval "$boxes"
T_DRY=90  # each check of a dry run

# the command line of each step, defined once: the run executes them, the dry run checks that they parse
read -ra tests_extra <<<"${TESTS_EXTRA:-}"
read -ra train_extra <<<"${TRAIN_EXTRA:-}"
read -ra bench_extra <<<"${BENCH_EXTRA:-}"
read -ra compile_extra <<<"${COMPILE_EXTRA:-}"
read -ra verl_extra <<<"${VERL_EXTRA:-}"
# only the files that hold a CUDA test: collecting the whole tree (~1,400 tests) would cost the box seconds for
# nothing; tests/with_verl/ is the verl step's
mapfile -t cuda_files < <(grep -rlE --include='test_*.py' 'mark\.cuda' tests | grep -v '^tests/with_verl/' | sort)
[ ${#cuda_files[@]} -gt 0 ] || cuda_files=(tests)
TESTS=(-m pytest -m cuda -q -rs -p no:cacheprovider "${cuda_files[@]}" "${tests_extra[@]}")
TRAIN=(-m ppo_critic train trainer.steps=50 trainer.device=cuda "trainer.run_dir=$work/train" trainer.resume=never
  trainer.progress=false trainer.log_every=10 "${train_extra[@]}")
# the baseline, the packed path, then the levers of the performance issue one by one (+dyn: token-budget
# micro-batches; +fused: fused AdamW; +bf16p: bf16 parameters, float32 master weights), megatron TP=1; one profiled update each. The last lever (+compile: torch.compile
# per decoder layer) is the compile step's, its cold compile in a box of its own; its row compares it with this
# step's padded baseline (same rollouts, same weights)
# shellcheck disable=SC2054  # the commas separate the paths of one option
BENCH=(-m ppo_critic bench paths=padded,packed,packed+dyn,packed+dyn+fused,packed+dyn+fused+bf16p,megatron
  device=cuda repeats=3 profile=true "out=$out/bench.json" "${bench_extra[@]}")
COMPILE=(-m ppo_critic bench paths=packed+dyn+fused+compile device=cuda repeats=3 profile=true
  "out=$out/compile.json" "${compile_extra[@]}")
VERL_SUITE=tests/with_verl/engine
vpy=$py  # the box runs the suite with its python3; here (--dry-run) it collects in the suite's own venv
[ "$dry" = 1 ] && vpy=${VERL_PYTHON:-.venv-verl-0.9.1/bin/python}
VERL=(-m pytest -q -rs -p no:cacheprovider "$VERL_SUITE" "${verl_extra[@]}")

wants() { [[ ",$steps," == *",$1,"* ]]; }
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$rows"; }
status_of() {  # a command's exit status -> ok / timeout / FAIL (timeout: 124; 137 once it had to be killed)
  case "$1" in 0) echo ok ;; 124 | 137) echo timeout ;; *) echo FAIL ;; esac
}
boxed() {  # boxed SECONDS LOG CMD...: CMD under `timeout` (cut to the run's DEADLINE), output to LOG; SIGINT first,
  # so pytest still prints its summary and the bench its table of the rounds done (its JSON is rewritten every round)
  local limit=$1 log=$2
  shift 2
  [ "$dry" = 1 ] || limit=$((limit < DEADLINE - SECONDS ? limit : DEADLINE - SECONDS))
  echo "+ $*" >>"$log"
  if [ "$limit" -lt 1 ]; then
    echo "not run: the run's $DEADLINE s are spent" >>"$log"
    return 124
  fi
  timeout -s INT -k "$KILL_GRACE" "$limit" "$@" >>"$log" 2>&1
}
site_path() { echo "$root/src:$work/site/$1${PYTHONPATH:+:$PYTHONPATH}"; }
missing_list() { "$py" "$harness" missing "$wheels"; }

install_group() {  # install_group SECONDS LOG TARGET GROUP...: the carried wheels of GROUPs into $work/site/TARGET
  local limit=$1 log=$2 target=$work/site/$3 files=()
  shift 3
  for group in "$@"; do
    for f in "$wheels/$group"/*.whl; do [ -e "$f" ] && files+=("$f"); done
  done
  rm -rf "$target"
  mkdir -p "$target"
  "$py" "$harness" dist-info "$target" || return 1  # ppo-critic's entry points (verl finds its plugin by them)
  [ ${#files[@]} -eq 0 ] && return 0
  boxed "$limit" "$log" "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" "${files[@]}"
}

# what the env row says of the software: versions, and whether CUDA and flash-attn are there
PROBE='
import importlib
import torch
found = []
for name in ("transformers", "triton", "flash_attn", "tensordict", "megatron.core"):
    short = name.split(".")[0]
    try:
        found.append(f"{short} {importlib.import_module(name).__version__}")
    except Exception as err:  # a missing package is a fact of this machine, reported in the row
        found.append(f"no {short} ({type(err).__name__})")
cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU" if torch.cuda.is_available() else "NO CUDA"
print(f"torch {torch.__version__} ({cuda}); " + ", ".join(found))
'

# ---- env: the machine and the installs ------------------------------------------------------------------------------
step_env() {
  local log=$out/env.log start=$SECONDS
  : >"$log"
  local absent
  absent=$(missing_list)
  if [ "$dry" = 1 ]; then
    local n
    n=$(grep -c . <<<"$absent")
    if [ "$n" -eq 0 ]; then
      row env ok $((SECONDS - start)) "every wheel of bench/gpu/wheels.txt is in $wheels/"
    elif [ "$allow_missing" = 1 ]; then
      row env ok $((SECONDS - start)) "$n wheels missing from $wheels/ (allowed; listed above)"
    else
      row env FAIL $((SECONDS - start)) "$n wheels missing from $wheels/ (listed above; bash bench/gpu/fetch_wheels.sh)"
    fi
    return
  fi
  # shellcheck disable=SC2054  # nvidia-smi's own comma-separated lists
  local gpu=(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)
  command -v nvidia-smi >/dev/null || gpu=(echo "no nvidia-smi")
  boxed 10 "$log" "${gpu[@]}"
  local name
  name=$(grep -v '^+ ' "$log" | head -1)
  install_group $((T_ENV - (SECONDS - start))) "$log" main main megatron \
    && echo "installed the main and megatron wheels into $work/site/main" >>"$log"
  PYTHONPATH=$(site_path main) boxed $((T_ENV - (SECONDS - start))) "$log" "$py" -c "$PROBE"
  local rc=$? versions
  versions=$(grep -v '^+ ' "$log" | tail -1)
  local status
  status=$(status_of $rc)
  [ -n "$absent" ] && status=FAIL && echo "missing wheels: $(tr '\n' ' ' <<<"$absent")" >>"$log"
  [[ "$versions" == *"NO CUDA"* ]] && status=FAIL
  local note=""
  [ -n "$absent" ] && note="; $(grep -c . <<<"$absent") wheels missing (env.log)"
  row env "$status" $((SECONDS - start)) "$name; $versions$note"
}

# ---- tests: every CUDA test ---------------------------------------------------------------------------------------
step_tests() {
  local log=$out/tests.log start=$SECONDS
  : >"$log"
  if [ "$dry" = 1 ]; then
    PYTHONPATH=$(site_path main) boxed "$T_DRY" "$log" "$py" "${TESTS[@]}" --collect-only
    local rc=$?
    row tests "$(status_of $rc)" $((SECONDS - start)) "would run $(collected "$log") (pytest exit $rc)"
    return
  fi
  PYTHONPATH=$(site_path main) boxed "$T_TESTS" "$log" "$py" "${TESTS[@]}"
  local rc=$?
  local status
  status=$(status_of $rc)
  [ $rc -eq 5 ] && status=FAIL  # no CUDA test was selected
  row tests "$status" $((SECONDS - start)) "$("$py" "$harness" row tests "$log")"
}

# ---- train: the main job on CUDA ------------------------------------------------------------------------------------
step_train() {
  local log=$out/train.log start=$SECONDS
  : >"$log"
  if [ "$dry" = 1 ]; then
    PYTHONPATH=$(site_path main) boxed "$T_DRY" "$log" "$py" "${TRAIN[@]}" --print-config
    local rc=$?
    row train "$(status_of $rc)" $((SECONDS - start)) "options parse (--print-config exit $rc)$(tail_error "$log" $rc)"
    return
  fi
  rm -rf "$work/train"
  PYTHONPATH=$(site_path main) boxed "$T_TRAIN" "$log" "$py" "${TRAIN[@]}"
  local rc=$?
  row train "$(status_of $rc)" $((SECONDS - start)) \
    "$("$py" "$harness" row train "$work/train/metrics.jsonl")$(tail_error "$log" $rc)"
}

# ---- bench and compile: the lever matrix -----------------------------------------------------------------------------
bench_step() {  # bench_step STEP BOX JSON CMD...: one `ppo-critic bench` run into bench.log (compile appends), its row
  local name=$1 box=$2 json=$3 log=$out/bench.log start=$SECONDS
  shift 3
  if [ "$name" = bench ] || ! wants bench; then : >"$log"; fi
  if [ "$dry" = 1 ]; then
    PYTHONPATH=$(site_path main) boxed "$T_DRY" "$log" "$py" "$@" check=true
    local rc=$?
    row "$name" "$(status_of $rc)" $((SECONDS - start)) "options parse (check=true exit $rc)$(tail_error "$log" $rc)"
    return
  fi
  rm -f "$json"
  PYTHONPATH=$(site_path main) boxed "$box" "$log" "$py" "$@"
  local rc=$?
  local status key
  status=$(status_of $rc)
  key=$("$py" "$harness" row "$name" "$json")
  [ "$status" = ok ] && [[ "$key" == *"errors: "* ]] && status=FAIL  # a path failed; the others still measured
  [ $rc -eq 124 ] || [ $rc -eq 137 ] || key="$key$(tail_error "$log" $rc)"
  row "$name" "$status" $((SECONDS - start)) "$key"
}
step_bench() { bench_step bench "$T_BENCH" "$out/bench.json" "${BENCH[@]}"; }
step_compile() { bench_step compile "$T_COMPILE" "$out/compile.json" "${COMPILE[@]}"; }

# ---- verl: the verl 0.9.1 engine suite ------------------------------------------------------------------------------
step_verl() {
  local log=$out/verl.log start=$SECONDS
  : >"$log"
  local skip
  skip=$("$py" "$harness" skip-reason "$wheels" verl)
  if [ "$dry" = 1 ]; then
    if [ ! -x "$vpy" ]; then
      row verl skipped $((SECONDS - start)) "not collected: no $vpy here (bash tests/with_verl/run.sh 0.9.1 builds it)"
      return
    fi
    PPO_CRITIC_VERL_SUITE=$VERL_SUITE boxed "$T_DRY" "$log" "$vpy" "${VERL[@]}" -m cuda --collect-only
    local rc=$?
    row verl "$(status_of $rc)" $((SECONDS - start)) "would run $(collected "$log") (pytest exit $rc)${skip:+; $skip}"
    return
  fi
  if [ -n "$skip" ]; then
    echo "$skip" >>"$log"
    row verl skipped 0 "$skip"
    return
  fi
  if ! install_group $((T_VERL / 2)) "$log" verl verl; then
    row verl FAIL $((SECONDS - start)) "installing the verl wheels failed$(tail_error "$log" 1)"
    return
  fi
  # its CUDA tests only: the others compare the engine with a float32 CPU reference at 1e-5, which a bf16 GPU run of
  # the engine cannot meet (they run on the CPU in CI)
  PYTHONPATH=$(site_path verl) PPO_CRITIC_VERL_SUITE=$VERL_SUITE boxed $((T_VERL - (SECONDS - start))) "$log" \
    "$py" "${VERL[@]}" -m cuda
  local rc=$?
  row verl "$(status_of $rc)" $((SECONDS - start)) "$("$py" "$harness" row verl "$log")"
}

collected() {  # collected LOG: what pytest --collect-only selected: 'N tests (of M collected)'
  local line
  line=$(grep -oE "[0-9]+(/[0-9]+)? tests? collected" "$1" | tail -1)
  [ -z "$line" ] && { echo "no test"; return; }
  [[ "$line" == */* ]] && echo "${line%%/*} tests (of ${line#*/})" || echo "$line"
}
tail_error() {  # tail_error LOG RC: the log's last line after a failure, for the row (nothing when RC is 0)
  [ "$2" -eq 0 ] || echo ": $(grep -v '^+ ' "$1" | grep . | tail -1)"
}

if [ "$dry" = 1 ]; then
  echo "== bench/gpu/run.sh --dry-run: each step's command line is checked; nothing heavy runs"
  absent=$(wants env && missing_list)
  if [ -n "$absent" ]; then
    echo "wheels missing from $wheels/ (bash bench/gpu/fetch_wheels.sh fetches them):"
    while read -r line; do echo "  $line"; done <<<"$absent"
  fi
fi
"$py" "$harness" plan
for s in ${all_steps//,/ }; do
  wants "$s" || continue
  case "$s" in
    tests) echo "-- tests: $py ${TESTS[*]}" ;;
    train) echo "-- train: $py ${TRAIN[*]}" ;;
    bench) echo "-- bench: $py ${BENCH[*]}" ;;
    compile) echo "-- compile: $py ${COMPILE[*]}" ;;
    verl) echo "-- verl: PPO_CRITIC_VERL_SUITE=$VERL_SUITE $vpy ${VERL[*]} -m cuda" ;;
    env) echo "-- env: nvidia-smi, versions, the wheels of $wheels/ into $work/site/" ;;
  esac
  "step_$s"
done

# ---- the table, printed last ----------------------------------------------------------------------------------------
{
  echo "== bench/gpu/run.sh$([ "$dry" = 1 ] && echo " --dry-run"): logs in $out;" \
    "targets (valid tokens/s): update >= 150k, compute_values >= 500k"
  printf '%-7s %-8s %7s  %s\n' step status seconds "key numbers"
  total=0
  while IFS=$'\t' read -r name status seconds key; do
    printf '%-7s %-8s %7s  %s\n' "$name" "$status" "$seconds" "$key"
    total=$((total + seconds))
  done <"$rows"
  printf '%-7s %-8s %7s\n' total "" "$total"
} | tee "$out/summary.txt"
! cut -f2 "$rows" | grep -qvE '^(ok|skipped)$'
