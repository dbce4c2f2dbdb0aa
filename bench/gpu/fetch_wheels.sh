#!/usr/bin/env bash
# Run HERE (with network) before a GPU call: puts the wheels of bench/gpu/wheels.txt (what the GPU box's image lacks,
# for Python 3.12 on x86-64) into .whl/<group>/ (git-ignored), to be carried with `carry: [".whl"]`, then
# `bash bench/gpu/run.sh` there. Wheels already in .whl/ are kept; ones the list no longer names are removed.
# A wheel PyPI has only as an sdist is built here; ray's wheel is repacked import-only (wheels.txt says why). A group
# that does not fit the 64 MiB carry limit beside the working tree is left out whole (.whl/left_out.txt says why),
# and run.sh skips the step that needs it. Prints each wheel with its size and the total; exits 1 if a fetch failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
dest=.whl
harness=bench/gpu/harness.py
# pip matches manylinux tags exactly: name every glibc level the box (glibc >= 2.28) can load
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
target=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in "${platforms[@]}"; do target+=(--platform "$p"); done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
mkdir -p "$dest"
python3 "$harness" prune "$dest" || exit 1
failed=()
while read -r group requirement how; do
  dir="$dest/$group"
  mkdir -p "$dir"
  echo "fetching $requirement ($group, $how)"
  if [ "$how" = sdist ]; then  # PyPI has no wheel of it: build one (pure Python) from the sdist
    fetch=(python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$dir" "$requirement")
  else
    fetch=(python3 -m pip download -q --no-deps "${target[@]}" -d "$dir" "$requirement")
  fi
  if ! "${fetch[@]}" >"$log" 2>&1; then
    failed+=("$requirement")
    grep -vi "is ignored: it is neither" "$log" | tail -5 | sed 's/^/    /'
    continue
  fi
done < <(python3 "$harness" missing "$dest")
python3 "$harness" slim "$dest" || failed+=("(repacking the import-only wheels)")
echo "== .whl/ (group, size, file), against the 64 MiB carry limit"
python3 "$harness" budget "$dest" || exit 1
du -sh "$dest" | sed 's/^/disk: /'
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED to fetch: ${failed[*]}" >&2
  exit 1
fi
