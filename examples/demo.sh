#!/usr/bin/env bash
# The demo `make demo` runs: one MLP trained eagerly and through kiln_compile
# side by side, then speed, memory, a short IR excerpt and the kernels.
# Exits nonzero when the two disagree or the loss does not fall.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${BUILD:-build}/examples/train_compiled" "$@"
