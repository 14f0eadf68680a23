#!/bin/sh
# Compile-time checks of kiln.h's checked calls (see wrong_types.c):
#   tests/compile/run.sh CC INCLUDE_DIR
# Each case must fail to compile with its message at its marked line; the
# file without a case must compile with no warning. GCC also warns (a
# warning, not an error) when ndim runs past a constant array.
set -u
cc=$1
inc=$2
dir=$(dirname "$0")
src=$dir/wrong_types.c
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fails=0

line_of() { grep -n "case: $1 " "$src" | cut -d: -f1; }

# expect_error CASE REGEX: an error at the case's line matching REGEX
expect_error() {
  line=$(line_of "$1")
  if "$cc" -std=c17 -fsyntax-only -Wall -Wextra -I"$inc" -DCASE_"$1" "$src" >"$out" 2>&1; then
    echo "FAIL $1: compiled"; fails=$((fails + 1)); return
  fi
  # the error is at the line, or in kiln.h with the line in its expansion notes
  if ! grep -E "error: " "$out" | grep -Eq "$2" || ! grep -Eq "wrong_types\.c:$line:[0-9]+:" "$out"; then
    echo "FAIL $1: no error matching '$2' at line $line:"; cat "$out"; fails=$((fails + 1)); return
  fi
  echo "ok   $1: $(grep -E "error: " "$out" | grep -E "$2" | head -1 | sed 's/.*error: //')"
}

if ! "$cc" -std=c17 -c -o /dev/null -Wall -Wextra -Wshadow -pedantic -Werror -I"$inc" "$src" >"$out" 2>&1; then
  echo "FAIL the calls written right do not compile cleanly:"; cat "$out"; exit 1
fi
echo "ok   the calls written right compile with -Wall -Wextra -Wshadow -pedantic -Werror"

expect_error int_shape 'incompatible[- ]pointer[- ]types'
expect_error int_shape_literal 'incompatible[- ]pointer[- ]types'
expect_error int_shape_not_last 'incompatible[- ]pointer[- ]types'
expect_error i64_axes 'incompatible[- ]pointer[- ]types'
expect_error float_perm 'incompatible[- ]pointer[- ]types'
expect_error number_for_tensor 'int-conversion|integer to pointer'
expect_error tensor_for_list 'incompatible[- ]pointer[- ]types'
expect_error rank_9 'more_sizes_than_KILN_MAX_DIMS'

if "$cc" --version | grep -qi gcc && ! "$cc" --version | grep -qi clang; then
  line=$(line_of ndim_past_array)
  "$cc" -std=c17 -c -o /dev/null -I"$inc" -DCASE_ndim_past_array "$src" >"$out" 2>&1
  if grep -E "wrong_types\.c:$line:[0-9]+:|stringop-overread" "$out" | grep -q "stringop-overread"; then
    echo "ok   ndim_past_array: warns (stringop-overread)"
  else
    echo "FAIL ndim_past_array: no -Wstringop-overread warning:"; cat "$out"; fails=$((fails + 1))
  fi
fi
exit $((fails > 0))
