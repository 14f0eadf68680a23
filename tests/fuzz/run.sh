#!/bin/sh
# Runs libFuzzer targets built with -DKILN_FUZZ=ON, one after the other, each
# for SECONDS: tests/fuzz/run.sh BUILD SECONDS TARGET...
# Each starts from its seeds (tests/fuzz/corpus/TARGET, replayed first, so a
# fixed finding stays fixed) and a work corpus in BUILD/fuzz/corpus/TARGET that
# later runs go on from. Crashes go to BUILD/fuzz/artifacts/. Exits 1 when a
# target failed; prints executions and corpus size per target.
set -u
build=$1 secs=$2
shift 2
src=$(cd "$(dirname "$0")" && pwd)
sym=/usr/lib/llvm-19/bin/llvm-symbolizer
[ -x "$sym" ] && export ASAN_SYMBOLIZER_PATH="$sym"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
mkdir -p "$build/fuzz/artifacts"
status=0
summary=""
for t in "$@"; do
  bin="$build/fuzz/$t"
  work="$build/fuzz/corpus/$t"
  log="$build/fuzz/$t.log"
  mkdir -p "$work"
  dict=""
  [ -f "$src/${t#fuzz_}.dict" ] && dict="-dict=$src/${t#fuzz_}.dict"
  echo "== $t: $secs s (log: $log)"
  start=$(date +%s)
  # -timeout: one input running longer is a hang; -rss_limit_mb: the process's memory
  # FUZZ_SEED and FUZZ_RUNS (make fuzz-ci sets them) make a run repeatable: the
  # same mutations in the same order, so a CI failure reproduces anywhere
  extra=""
  [ -n "${FUZZ_SEED:-}" ] && extra="$extra -seed=$FUZZ_SEED"
  [ -n "${FUZZ_RUNS:-}" ] && extra="$extra -runs=$FUZZ_RUNS"
  "$bin" -max_total_time="$secs" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 $extra \
    -artifact_prefix="$build/fuzz/artifacts/$t-" $dict "$work" "$src/corpus/$t" >"$log" 2>&1
  rc=$?
  end=$(date +%s)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  files=$(ls "$work" | wc -l)
  line="$t: ${execs:-?} executions in $((end - start)) s, work corpus $files files"
  if [ $rc -ne 0 ]; then
    status=1
    line="$line, FAILED (exit $rc)"
    grep -E "ERROR|fuzz check|SUMMARY|Test unit written" "$log" | head -20
  fi
  echo "$line"
  summary="$summary$line
"
done
printf '\n%s' "$summary"
exit $status
