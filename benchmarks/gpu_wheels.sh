#!/usr/bin/env bash
# The wheels the GPU check needs that the borrowed machine's image lacks, downloaded into ./.whl for
# CPython 3.12 on manylinux x86-64 (that machine reaches no registry: the wheels travel with the working
# tree, which may be 64 MiB in all). gpu_check.sh installs them there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# and puts /tmp/site on PYTHONPATH.
#   xgrammar (+ pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions >= 4.16 for
#     pydantic, apache-tvm-ffi): structured outputs' grammars and token bitmasks (engine/structured.py).
#   flashinfer-python 0.6.5 (7.8 MB; the 0.7 wheels are 34-101 MB): paged MLA decode (kernels/mla_flashinfer.py);
#     its other needs (click, einops, ninja, nvidia-ml-py, requests, tabulate, ...) are in the image; cudnn-frontend
#     and cutlass-dsl are not, and flashinfer.mla does not import them.
#   jsonschema (+ jsonschema-specifications, referencing, rpds-py; attrs is in the image): the structured-output
#     tests validate what the engine generated.
# Versions are pinned to the ones this project's CPU venv runs (one version per package: two in .whl stop the
# whole install there). Idempotent: a wheel already in .whl is kept; another version of a pinned package is
# removed. Ends by printing the bundle's total and checking it against 64 MiB minus the working tree.
# Usage: bash benchmarks/gpu_wheels.sh        (here, with network; PYTHON=... picks the pip to use)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
DEST=.whl
LIMIT=$((64 * 1024 * 1024))
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# name==version as pip takes it, and the wheel file name's prefix (the name normalized)
PINS=(
  "xgrammar==0.2.9"
  "apache-tvm-ffi==0.1.15.post2"
  "pydantic==2.14.4"
  "pydantic-core==2.50.5"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"
  "flashinfer-python==0.6.5"
  "jsonschema==4.26.0"
  "jsonschema-specifications==2025.9.1"
  "referencing==0.37.0"
  "rpds-py==2026.9.1"
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$DEST"
failed=0
for pin in "${PINS[@]}"; do
  name=${pin%%==*}
  version=${pin##*==}
  stem=$(echo "$name" | tr '-' '_')
  have=$(ls "$DEST"/"$stem"-"$version"-*.whl 2>/dev/null | head -1)
  for other in "$DEST"/"$stem"-*.whl; do
    [ -e "$other" ] || continue
    case "$other" in
      "$DEST/$stem-$version-"*) ;;
      *) echo "removing $other (another version than $version)"; rm -f "$other" ;;
    esac
  done
  if [ -n "$have" ]; then
    echo "have     $(basename "$have")"
    continue
  fi
  if "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$DEST" "$pin" >/dev/null 2>"$DEST/.pip-error"; then
    echo "fetched  $(basename "$(ls "$DEST"/"$stem"-"$version"-*.whl | head -1)")"
  else
    echo "FAILED   $pin: $(tail -1 "$DEST/.pip-error")"
    failed=1
  fi
  rm -f "$DEST/.pip-error"
done
wheels=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -b 2>/dev/null | awk '{s += $1} END {print s + 0}')
count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
room=$((LIMIT - tree))
awk -v n="$count" -v w="$wheels" -v t="$tree" -v r="$room" 'BEGIN {
  printf "wheels: %d files, %.1f MiB; working tree %.1f MiB; room under 64 MiB: %.1f MiB\n", n, w / 2^20, t / 2^20, r / 2^20 }'
if [ "$wheels" -gt "$room" ]; then
  echo "the wheels do not fit: $wheels bytes, room for $room"
  exit 1
fi
exit $failed
