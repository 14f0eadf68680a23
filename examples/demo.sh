#!/usr/bin/env bash
# The demo `make demo` runs: a small GPT (examples/gpt.c) trained on the bytes
# of Genesis eagerly and through kiln_compile side by side, loss curves, speed,
# memory, a sample generated with the compiled forward (one variant, the
# sequence length symbolic), an excerpt of the IR and of the kernel list.
# Exits nonzero when the two sides disagree, the loss does not fall, or a
# check fails. Extra arguments go to the program (--steps N).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${BUILD:-build}/examples/gpt"
log=$(mktemp)
trap 'rm -f "$log"' EXIT

status=0
"$bin" --kernels "$@" 2>"$log" || status=$?
# kiln's warnings and errors go to stderr too: never hide them
grep -v -E '^(=== kiln kernels|kernels of|  k[0-9]|      %|buffers:|  b[0-9]|fusion and lowering|compile time|memory plan)' \
  "$log" >&2 || true
if [ "$status" -ne 0 ]; then
  echo "demo: the gpt example failed (exit $status)" >&2
  exit "$status"
fi

echo
echo "the kernels of the compiled next-byte function, up to the attention (KILN_DUMP=kernels):"
awk '/^kernels of next_byte/ { on = 1 } on && /^  k9_/ { exit } on' "$log" | sed 's/^/  /'
echo "  ..."
grep -m1 -A0 '^compile time' <(awk '/^kernels of next_byte/ { on = 1 } on' "$log") | sed 's/^/  /' || true
