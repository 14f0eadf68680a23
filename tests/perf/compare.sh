#!/bin/sh
# Runs one program of tests/perf against two builds of kiln, alternating, and
# prints each case's best time in both and their ratio (new / old):
#
#   tests/perf/compare.sh PROGRAM OLD_BUILD_DIR NEW_BUILD_DIR [alternations]
#
#   tests/perf/compare.sh lifetime ../before/build build     tensor lifetime costs
#   tests/perf/compare.sh eager_loops build-native build     -march=native or not
#
# PROGRAM is tests/perf/PROGRAM.c; each build dir holds a libkiln.so. The
# program is compiled once per build, with the kiln.h of the checkout that
# build came from. Each alternation runs each case 3 times.
set -eu
prog=$1
old=$2
new=$3
alt=${4:-5}
here=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build() { # build_dir out
  inc=$here/include
  src_inc=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$1/CMakeCache.txt")/include
  [ -f "$src_inc/kiln.h" ] && inc=$src_inc
  cc -std=c17 -O2 -I"$inc" "$here/tests/perf/$prog.c" -L"$1" -lkiln -Wl,-rpath,"$(cd "$1" && pwd)" -o "$2"
}
build "$old" "$tmp/old"
build "$new" "$tmp/new"
for i in $(seq "$alt"); do
  "$tmp/old" 3 >>"$tmp/old.txt"
  "$tmp/new" 3 >>"$tmp/new.txt"
done
# the best of all alternations, per case, in the program's order
best() { awk -F'  +' '{ v = $2; sub(/ [mn]s$/, "", v); if (!($1 in b) || v + 0 < b[$1]) b[$1] = v + 0; if (!($1 in o)) o[$1] = n++ }
  END { for (k in o) printf "%d\t%s\t%.3f\n", o[k], k, b[k] }' "$1" | sort -n | cut -f2-; }
best "$tmp/old.txt" >"$tmp/old.best"
best "$tmp/new.txt" >"$tmp/new.best"
unit=$(head -1 "$tmp/old.txt" | awk '{ print $NF }')
printf "%-26s %10s %10s %8s\n" "case ($unit)" old new new/old
paste "$tmp/old.best" "$tmp/new.best" | awk -F'\t' '{ printf "%-26s %10.3f %10.3f %8.3f\n", $1, $2, $4, $4 / $2 }'
