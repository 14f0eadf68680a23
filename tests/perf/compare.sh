#!/bin/sh
# Runs tests/perf/lifetime.c against two builds of kiln, alternating, and
# prints each case's time in both and their ratio (new / old):
#
#   tests/perf/compare.sh OLD_BUILD_DIR NEW_BUILD_DIR [alternations]
#
# Each build dir holds libkiln.so; the program is compiled once per build,
# with that build's include/ when it is a build of another checkout
# (OLD_BUILD_DIR/../include), else this checkout's.
set -eu
old=$1
new=$2
alt=${3:-5}
here=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build() { # build_dir out
  inc=$here/include
  src_inc=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$1/CMakeCache.txt")/include
  [ -f "$src_inc/kiln.h" ] && inc=$src_inc
  cc -std=c17 -O2 -I"$inc" "$here/tests/perf/lifetime.c" -L"$1" -lkiln -Wl,-rpath,"$(cd "$1" && pwd)" -o "$2"
}
build "$old" "$tmp/old"
build "$new" "$tmp/new"
for i in $(seq "$alt"); do
  "$tmp/old" 3 >>"$tmp/old.txt"
  "$tmp/new" 3 >>"$tmp/new.txt"
done
# the best of all alternations, per case
best() { awk -F'  +' '{ gsub(/ ns/, "", $2); if (!($1 in b) || $2 + 0 < b[$1]) b[$1] = $2 + 0; if (!($1 in o)) o[$1] = n++ }
  END { for (k in o) printf "%d\t%s\t%.1f\n", o[k], k, b[k] }' "$1" | sort -n | cut -f2-; }
best "$tmp/old.txt" >"$tmp/old.best"
best "$tmp/new.txt" >"$tmp/new.best"
printf "%-26s %10s %10s %7s\n" case "old ns" "new ns" "new/old"
paste "$tmp/old.best" "$tmp/new.best" | awk -F'\t' '{ printf "%-26s %10.1f %10.1f %7.3f\n", $1, $2, $4, $4 / $2 }'
