#!/bin/sh
# The benchmark's Python: a virtual environment with pinned PyTorch 2.x
# (torch.compile), JAX on CPU (jax.jit), numpy, matplotlib and safetensors,
# made once.
#
#   bench/venv.sh DIR        (run.sh calls it with $BUILD/venv)
#
# DIR/.pins records what was installed; a later call with the same pins
# does nothing, a call with other pins installs them over the old ones.
# Prints DIR/bin/python on success. On failure (no network, a wheel
# missing for this Python) it prints the reason on stderr and exits 1: the
# caller falls back to the system Python, whose columns are then empty.
# Only the benchmark uses this environment; the build and the tests never do.
set -eu

# The pins. PyTorch from the default index brings its CUDA libraries along
# (about 6 GB), which its import needs even when it only runs on the CPU.
# safetensors: PyTorch's side of bench/torch_roundtrip.py.
PINS="torch==2.15.0 jax[cpu]==0.10.2 numpy==2.4.6 matplotlib==3.11.2 safetensors==0.8.0"

dir=${1:?usage: bench/venv.sh DIR}
stamp=$dir/.pins
py=$dir/bin/python

if [ -x "$py" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$PINS" ]; then
  echo "$py"
  exit 0
fi

base=/usr/bin/python3
[ -x "$base" ] || base=$(command -v python3)
if [ ! -x "$py" ]; then
  echo "venv: creating $dir" >&2
  if ! "$base" -m venv "$dir" >&2; then
    echo "venv: python3 -m venv failed (apt-get install python3-venv)" >&2
    rm -rf "$dir"
    exit 1
  fi
fi
echo "venv: installing $PINS (once; several GB with PyTorch's CUDA libraries)" >&2
rm -f "$stamp"
# shellcheck disable=SC2086 # PINS is a word list
if ! "$py" -m pip install --disable-pip-version-check --no-input $PINS >"$dir/pip.log" 2>&1; then
  tail -n 5 "$dir/pip.log" >&2
  echo "venv: pip install failed (log: $dir/pip.log)" >&2
  exit 1
fi
printf '%s\n' "$PINS" >"$stamp"
echo "$py"
