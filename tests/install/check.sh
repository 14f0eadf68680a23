#!/bin/sh
# The install check that `make test` runs (ctest test_install):
#
#   tests/install/check.sh BUILD_DIR CMAKE CC PKG_CONFIG
#
# 1. cmake --install BUILD_DIR into a temporary prefix;
# 2. pkg-config: builds app.c with `pkg-config --cflags --libs kiln` and
#    runs it, then links libkiln.a with `pkg-config --static --libs kiln`;
# 3. find_package: builds tests/install as a project (kiln::kiln and
#    kiln::kiln_static) and runs both programs;
# 4. add_subdirectory: configures tests/install/subproject, which builds kiln
#    from this checkout inside its tree, and checks that it registers no
#    test and does not look for Check.
# 5. the runtime: the installed kilnc exports tests/install/twice.kiln, and
#    rt_app.c links the object with `pkg-config --libs kiln_rt` alone.
# Each program must print "ok VERSION VERSION" with the version of kiln.h.
set -eu
build=$(cd "$1" && pwd)
cmake=$2
cc=$3
pkgconfig=$4
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() {
  echo "FAIL: $*"
  exit 1
}
log() { # log NAME: run the rest, output to $tmp/NAME.log, shown on failure
  name=$1
  shift
  "$@" >"$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; fail "$name: $*"; }
}
version=$(sed -n 's/^#define KILN_VERSION_STRING "\(.*\)"$/\1/p' "$src/include/kiln.h")
expect_ok() { # expect_ok PROGRAM
  out=$("$1") || fail "$1 exited $?: $out"
  [ "$out" = "ok $version $version" ] || fail "$1 printed '$out', not 'ok $version $version'"
  echo "ok   $(basename "$1"): $out"
}

log install "$cmake" --install "$build" --prefix "$prefix"
for f in include/kiln.h include/kiln_rt.h bin/kilnc share/doc/kiln/LICENSE share/doc/kiln/CHANGELOG.md; do
  [ -f "$prefix/$f" ] || fail "the install has no $f"
done
pc=$(find "$prefix" -name kiln.pc)
[ -n "$pc" ] || fail "the install has no kiln.pc"
config=$(find "$prefix" -name kilnConfig.cmake)
[ -n "$config" ] || fail "the install has no kilnConfig.cmake"
libdir=$(dirname "$(dirname "$pc")")
echo "ok   installed into a temporary prefix: $(cd "$prefix" && find . -type f | sort | tr '\n' ' ')"

# 2. pkg-config
export PKG_CONFIG_PATH="$(dirname "$pc")"
[ "$("$pkgconfig" --modversion kiln)" = "$version" ] || fail "kiln.pc's version is not $version"
[ "$("$pkgconfig" --variable=libdir kiln)" -ef "$libdir" ] || fail "kiln.pc's libdir is not $libdir"
log cc_pc "$cc" -std=c17 -Wall -Wextra -Werror "$here/app.c" $("$pkgconfig" --cflags --libs kiln) \
  -Wl,-rpath,"$libdir" -o "$tmp/app_pkgconfig"
expect_ok "$tmp/app_pkgconfig"
static_libs=$("$pkgconfig" --static --libs kiln | sed "s|-lkiln\b|$libdir/libkiln.a|")
log cc_pc_static "$cc" -std=c17 "$here/app.c" $("$pkgconfig" --cflags kiln) $static_libs -o "$tmp/app_pkgconfig_static"
expect_ok "$tmp/app_pkgconfig_static"

# 3. find_package
log fp_configure "$cmake" -S "$here" -B "$tmp/fp" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_TYPE=Release
log fp_build "$cmake" --build "$tmp/fp"
expect_ok "$tmp/fp/app_shared"
expect_ok "$tmp/fp/app_static"

# 4. add_subdirectory
log sub_configure "$cmake" -S "$here/subproject" -B "$tmp/sub" -DKILN_SOURCE_DIR="$src" -DCMAKE_C_COMPILER="$cc"
grep -q "pkg_config_checked_check\|^check_FOUND" "$tmp/sub/CMakeCache.txt" && fail "add_subdirectory(kiln) looked for Check"
tests=$(cd "$tmp/sub" && "$(dirname "$cmake")/ctest" -N | sed -n 's/^Total Tests: //p')
[ "$tests" = 0 ] || fail "add_subdirectory(kiln) added $tests tests to the parent project"
echo "ok   add_subdirectory: configures without Check and adds no tests"

# 5. the runtime, with the installed kilnc
log kilnc "$prefix/bin/kilnc" "$here/twice.kiln" -o "$tmp/twice.o"
log cc_rt "$cc" -std=c17 -Wall -Wextra -Werror -I"$tmp" "$here/rt_app.c" "$tmp/twice.o" \
  $("$pkgconfig" --cflags --libs kiln_rt) -Wl,-rpath,"$libdir" -o "$tmp/rt_app"
ldd "$tmp/rt_app" | grep -qi -e llvm -e 'libkiln\.' && fail "rt_app loads libkiln or LLVM: $(ldd "$tmp/rt_app")"
[ "$("$tmp/rt_app")" = ok ] || fail "rt_app: $("$tmp/rt_app")"
echo "ok   kilnc and libkiln_rt: an exported graph runs with neither libkiln nor LLVM loaded"
