#!/bin/sh
# The benchmark report in one run: kiln eager, kiln compiled, PyTorch eager,
# TorchScript (and torch.compile where installed), then tables and plots.
#
#   bench/run.sh [--threads N] [--only W1,W3] [--docs | --no-docs]
#
# N (default: the number of cores) is the thread count of the side-by-side
# run; kiln eager and PyTorch eager also run at 1 thread. Needs
# $BUILD/bench/kiln_bench ($BUILD defaults to build); the PyTorch columns stay
# empty when PyTorch is missing. Writes the run to $BUILD/bench/ (JSON,
# tables.md, img/). A full run (no --only) in which every step succeeded also
# rewrites the generated section of docs/perf.md and the plots in docs/img/;
# --docs/--no-docs force either way (a failed step still keeps the docs).
set -eu
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
BIN=$BUILD/bench/kiln_bench
OUT=$BUILD/bench
PY=/usr/bin/python3

usage() {
  echo "usage: bench/run.sh [--threads N] [--only W1,W3] [--docs | --no-docs]" >&2
  exit 2
}

threads=""
only=""
docs=auto
while [ $# -gt 0 ]; do
  case "$1" in
  --threads) [ $# -ge 2 ] || usage; threads=$2; shift 2 ;;
  --only) [ $# -ge 2 ] || usage; only=$2; shift 2 ;;
  --docs) docs=yes; shift ;;
  --no-docs) docs=no; shift ;;
  *) usage ;;
  esac
done
case "$threads" in
"") threads=$(nproc 2>/dev/null || echo 1) ;;
*[!0-9]* | 0) usage ;;
esac
if [ "$docs" = auto ]; then
  if [ -n "$only" ]; then docs=no; else docs=yes; fi
fi

if [ ! -x "$BIN" ]; then
  echo "run.sh: $BIN not found; build first (make)" >&2
  exit 1
fi
mkdir -p "$OUT"
# never merge a stale run
rm -f "$OUT/machine.json" "$OUT/kiln_eager.json" "$OUT"/kiln_eager_t*.json "$OUT/torch.json" \
  "$OUT/compiled.json" "$OUT/overhead.txt" "$OUT/report.json" "$OUT/tables.md"

set -- # the options each program is given
[ -n "$only" ] && set -- --only "$only"
# W8 and W9 (bench/gpt.c), W13, W14 and R50 (bench/resnet.c) exist in kiln_bench --compiled only
eager_only=$(echo "$only" | tr , '\n' | grep -v '^W[89]\|^W1[34]\|^R50' | paste -sd, -) || true
thread_list=1
[ "$threads" != 1 ] && thread_list="1 $threads"

status=0
"$PY" bench/machine.py --build "$BUILD" --json "$OUT/machine.json" || status=$?
for t in $thread_list; do
  if [ -z "$only" ]; then
    echo "== kiln eager, $t thread(s)"
    "$BIN" --threads "$t" --json "$OUT/kiln_eager_t$t.json" || status=$?
  elif [ -n "$eager_only" ]; then
    echo "== kiln eager, $t thread(s)"
    "$BIN" --threads "$t" --json "$OUT/kiln_eager_t$t.json" --only "$eager_only" || status=$?
  fi
done
"$PY" - "$OUT" $thread_list <<'EOF' || status=$?
import json, os, sys
out, rows = sys.argv[1], []
for t in sys.argv[2:]:
    path = os.path.join(out, f"kiln_eager_t{t}.json")
    if os.path.exists(path):
        with open(path) as f:
            rows += json.load(f)
with open(os.path.join(out, "kiln_eager.json"), "w") as f:
    json.dump(rows, f, indent=2)
EOF
echo "== kiln eager vs kiln compiled (side by side), $threads thread(s)"
"$BIN" --compiled --threads "$threads" --json "$OUT/compiled.json" "$@" || status=$?
echo "== compiled call overhead"
"$BIN" --overhead >"$OUT/overhead.txt" || status=$?
cat "$OUT/overhead.txt"
echo "== PyTorch: eager, fused ops, TorchScript, torch.compile"
# Idle OpenMP workers sleep instead of spinning: spinning, they fight
# OpenBLAS's own threads for the cores, and PyTorch at 2 threads on 2 cores
# ran the GPT workloads 10-30x slower than at 1. Set it to override.
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} "$PY" bench/torch_workloads.py \
  --threads "$(echo $thread_list | tr ' ' ,)" --json "$OUT/torch.json" "$@" || status=$?
echo "== PyTorch: the ResNets (W13, W14), eager and torch.compile"
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} "$PY" bench/torch_resnet.py \
  --threads "$threads" --json "$OUT/torch_resnet.json" "$@" || status=$?
echo "== report"
if [ "$docs" = yes ] && [ "$status" -ne 0 ]; then
  echo "run.sh: a step failed (status $status); docs/perf.md and docs/img/ left alone" >&2
  docs=no
fi
if [ "$docs" = yes ]; then
  "$PY" bench/report.py --dir "$OUT" --perf-md docs/perf.md --img-dir docs/img || status=$?
else
  "$PY" bench/report.py --dir "$OUT" || status=$?
fi
exit "$status"
