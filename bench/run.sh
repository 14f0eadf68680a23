#!/bin/sh
# The benchmark report in one run: kiln eager and compiled, PyTorch eager and
# fused ops, torch.compile (default and max-autotune-no-cudagraphs) and JAX
# jit, side by side; then tables and plots.
#
#   bench/run.sh [--threads N] [--only W1,W3] [--docs | --no-docs] [--no-venv]
#
# N (default: the number of cores) is the thread count of the side-by-side
# run; kiln eager and PyTorch eager also run at 1 thread. Needs
# $BUILD/bench/kiln_bench ($BUILD defaults to build). The Python side runs in
# $BUILD/venv, which bench/venv.sh makes once (pinned PyTorch, JAX, numpy,
# matplotlib from PyPI); when it cannot (no network), or with --no-venv, the
# system python3 runs instead and the columns of what it lacks stay empty,
# with the reason in the report. Writes the run to $BUILD/bench/ (JSON,
# tables.md, img/). A full run (no --only) in which every step succeeded
# also rewrites the generated section of docs/perf.md and the plots in
# docs/img/; --docs/--no-docs force either way.
set -eu
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
BIN=$BUILD/bench/kiln_bench
OUT=$BUILD/bench

usage() {
  echo "usage: bench/run.sh [--threads N] [--only W1,W3] [--docs | --no-docs] [--no-venv]" >&2
  exit 2
}

threads=""
only=""
docs=auto
venv=yes
while [ $# -gt 0 ]; do
  case "$1" in
  --threads) [ $# -ge 2 ] || usage; threads=$2; shift 2 ;;
  --only) [ $# -ge 2 ] || usage; only=$2; shift 2 ;;
  --docs) docs=yes; shift ;;
  --no-docs) docs=no; shift ;;
  --no-venv) venv=no; shift ;;
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
rm -f "$OUT/machine.json" "$OUT/side_by_side.json" "$OUT/compiled.json" "$OUT/overhead.txt" \
  "$OUT/report.json" "$OUT/tables.md"

status=0
note=""
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
if [ "$venv" = yes ]; then
  echo "== Python: $BUILD/venv"
  if py=$(bench/venv.sh "$BUILD/venv"); then
    PY=$py
    note="Python packages from $BUILD/venv (bench/venv.sh: $(cat "$BUILD/venv/.pins"))"
  else
    note="bench/venv.sh could not set up $BUILD/venv (see $BUILD/venv/pip.log); the system python3 ran instead"
    echo "run.sh: $note; what it lacks stays empty" >&2
    [ "$docs" = yes ] && docs=no-venv
  fi
else
  note="the system python3 (--no-venv)"
fi

set -- # the options each program is given
[ -n "$only" ] && set -- --only "$only"
thread_list=1
[ "$threads" != 1 ] && thread_list="1,$threads"

"$PY" bench/machine.py --build "$BUILD" --json "$OUT/machine.json" || status=$?
echo "== kiln: eager vs compiled, compile times and memory, $threads thread(s)"
"$BIN" --compiled --threads "$threads" --json "$OUT/compiled.json" "$@" || status=$?
echo "== kiln: compiled call overhead"
"$BIN" --overhead >"$OUT/overhead.txt" || status=$?
cat "$OUT/overhead.txt"
echo "== side by side: kiln, PyTorch, torch.compile, JAX; threads $thread_list"
# Idle OpenMP workers sleep instead of spinning: spinning, they fight the
# next contender's threads for the cores (PyTorch at 2 threads on 2 cores ran
# the GPT workloads 10-30x slower than at 1). Set it to override.
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} "$PY" bench/side_by_side.py --kiln "$BIN" \
  --threads "$thread_list" --json "$OUT/side_by_side.json" --env-note "$note" "$@" || status=$?
echo "== report"
if [ "$docs" = yes ] && [ "$status" -ne 0 ]; then
  echo "run.sh: a step failed (status $status); docs/perf.md and docs/img/ left alone" >&2
  docs=no
fi
if [ "$docs" = no-venv ]; then
  echo "run.sh: no venv, so no PyTorch or JAX columns; docs/perf.md and docs/img/ left alone (--docs forces)" >&2
  docs=no
fi
if [ "$docs" = yes ]; then
  "$PY" bench/report.py --dir "$OUT" --perf-md docs/perf.md --img-dir docs/img || status=$?
else
  "$PY" bench/report.py --dir "$OUT" || status=$?
fi
exit "$status"
