#!/usr/bin/env bash
# The GPU check in one call on a machine with a GPU and its own Python and torch, but no network
# and not our dependencies (docs/benchmarks.md, "The GPU check"): `make gpu-wheels` here first
# fetches the wheels of what such a machine lacks into .whl/; this script installs them beside
# the machine's own packages (never its torch), and runs bench/gpu_check.py with the arguments
# given. Its log, its JSON line and its --dump (one archive) land in $OUT (or /tmp/gpu-check-out):
# three files, within what a lent machine sends back.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/bt-site .whl/*.whl
  export PYTHONPATH="/tmp/bt-site:$PWD"
fi
export PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
python3 bench/gpu_check.py --dump "$out/dump" "$@" 2>&1 | tee "$out/gpu_check.log"
tail -n 1 "$out/gpu_check.log" > "$out/gpu_check.json"
tar czf "$out/dump.tgz" -C "$out" dump && rm -rf "$out/dump"
