#!/usr/bin/env bash
# The demo `make demo` runs: trains the small MLP example eagerly.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${BUILD:-build}/examples/mlp_train" "$@"
