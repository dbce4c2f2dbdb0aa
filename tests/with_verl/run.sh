#!/usr/bin/env bash
# Run the verl integration suite for one verl version in its own cached virtual environment.
#   bash tests/with_verl/run.sh 0.7.1 [pytest args]
# The environment (.venv-verl-<version>/) is rebuilt only when its requirements or pyproject.toml change.
# verl is installed with --no-deps (its full dependency set pulls CUDA builds and pins that clash), then only
# what its critic paths import. The main test suite never needs verl.
set -euo pipefail
cd "$(dirname "$0")/../.."
version="${1:?usage: tests/with_verl/run.sh VERSION [pytest args]}"
shift
case "$version" in
  0.7.*) suite=tests/with_verl/legacy ;;  # the legacy critic API: ppo_critic.integrations.verl
  0.9.*) suite=tests/with_verl/engine ;;  # the engine plugin: critic.strategy=ppo_critic
  *) echo "tests/with_verl/run.sh: no suite for verl $version (known: 0.7.x, 0.9.x)" >&2; exit 2 ;;
esac
venv=".venv-verl-$version"
reqs="$suite/requirements.txt"
stamp="$(cat "$reqs" pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0  # the local CPU build first, as everywhere in this project
  grep -vE '^(#|verl==|$)' "$reqs" | xargs "$venv/bin/pip" install -q -e .
  "$venv/bin/pip" install -q --no-deps "$(grep -E '^verl==' "$reqs")"
  echo "$stamp" > "$venv/.stamp"
fi
PPO_CRITIC_VERL_SUITE="$suite" OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "$suite" "$@"
