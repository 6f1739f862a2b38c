#!/usr/bin/env bash
# The GPU check in one call on a machine with a GPU and its own Python and torch, but no network
# and not our dependencies (docs/benchmarks.md, "The GPU check"): `make gpu-wheels` here first
# fetches the wheels of what such a machine lacks into .whl/; this script installs them beside
# the machine's own packages (never its torch), and runs bench/gpu_check.py with the arguments
# given. Its log, its JSON line and its --dump (one archive) land in $OUT (or /tmp/gpu-check-out),
# with the CUDA tests' log and bench/prefill_graphs.py's: five files, within what a lent machine
# sends back.
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
# the CUDA-only tests first (streams, the first token read after an event, graphed == eager), then
# graphed against eager prefill (bench/prefill_graphs.py), then the check itself
timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/unit/test_lanes.py tests/unit/test_prefill_pieces.py tests/e2e/test_cuda.py 2>&1 | tee "$out/cuda_tests.log" || true
timeout 180 python3 bench/prefill_graphs.py 2>&1 | tee "$out/prefill_graphs.log" || true
python3 bench/gpu_check.py --dump "$out/dump" "$@" 2>&1 | tee "$out/gpu_check.log"
tail -n 1 "$out/gpu_check.log" > "$out/gpu_check.json"
tar czf "$out/dump.tgz" -C "$out" dump && rm -rf "$out/dump"
