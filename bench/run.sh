#!/bin/sh
# Benchmarks in one run: kiln eager against PyTorch, kiln eager against kiln compiled.
#   bench/run.sh [--threads N] [--only W1,W3]
# Needs $BUILD/bench/kiln_bench ($BUILD defaults to build); the torch side is
# skipped when PyTorch is missing. Writes $BUILD/bench/eager.json, compiled.json and tables.
set -eu
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
BIN=$BUILD/bench/kiln_bench
OUT=$BUILD/bench
PY=/usr/bin/python3
if [ ! -x "$BIN" ]; then
  echo "run.sh: $BIN not found; build first (make)" >&2
  exit 1
fi
mkdir -p "$OUT"
rm -f "$OUT/kiln_eager.json" "$OUT/torch_eager.json" "$OUT/compiled.json" # never merge a stale run

status=0
echo "== kiln eager"
"$BIN" --json "$OUT/kiln_eager.json" "$@" || status=$?
echo "== torch eager"
"$PY" bench/torch_workloads.py --json "$OUT/torch_eager.json" "$@" || status=$?
echo "== kiln eager vs kiln compiled (side by side)"
"$BIN" --compiled --json "$OUT/compiled.json" "$@" || status=$?
echo "== compiled call overhead"
"$BIN" --overhead || status=$?
echo "== kiln / torch"
"$PY" bench/report.py "$OUT/kiln_eager.json" "$OUT/torch_eager.json" --out "$OUT/eager.json"
exit "$status"
