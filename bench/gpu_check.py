"""The GPU check: BubbleTea on real compute, ready to run wherever a GPU is (`make gpu-check`).

PP=2 x DP=2 (four workers) with **no device profile at all**: training and prefill count for their
real compute, on the GPU when torch sees one (the workers' slots share whatever GPUs there are,
`shared.model.devices`), at time scale k = 1, BubbleTea on, an open-loop load at 80% of the bubbles'
capacity or `--max-rate` requests per second (default 200: what one host's front door and load
generator send comfortably), whichever is lower; the figures of `bench/bubble_fill.py` (every
bubble, every request). It prints the device first and one JSON line last, with the device in it.

On a machine without a GPU it runs the same on the CPU: a small smoke test of the real-compute
path (`tests/e2e/test_gpu_check.py` runs it that way, with a few iterations).

    python bench/gpu_check.py                      # 2 pairs of 8 iterations
    python bench/gpu_check.py --quick              # 1 pair of 3 iterations (the smoke test)
    python bench/gpu_check.py --dp 1               # PP=2 x DP=1: two workers (one GPU, or a small CPU)
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from contextlib import redirect_stdout

import bubble_fill


def device_line() -> dict[str, object]:
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return {"device": "cuda", "gpus": names, "torch": torch.__version__, "cuda": torch.version.cuda}
    return {"device": "cpu", "gpus": [], "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, help="training iterations per run; default 8 (--quick: 3)")
    ap.add_argument("--pairs", type=int, help="interleaved off/on pairs; default 2 (--quick: 1)")
    ap.add_argument(
        "--quick", action="store_true", help="one pair of 3 iterations at most 10 requests/s: the smoke test"
    )
    ap.add_argument("--max-rate", type=float, help="requests per real second at most; default 200 (--quick: 10)")
    ap.add_argument(
        "--dp", type=int, default=2, choices=(1, 2), help="data-parallel replicas, PP=2 x DP workers; default 2"
    )
    args = ap.parse_args(argv)
    args.iterations = args.iterations or (3 if args.quick else 8)
    args.pairs = args.pairs or (1 if args.quick else 2)
    args.max_rate = args.max_rate or (10.0 if args.quick else 200.0)
    device = device_line()
    print(
        f"gpu-check on {device['device']}: {', '.join(device['gpus']) or 'no GPU'} (torch {device['torch']})",  # type: ignore[arg-type]
        file=sys.stderr,
        flush=True,
    )
    out = io.StringIO()
    with redirect_stdout(out):
        case = ["--dp", str(args.dp), "--mode", "real", "--time-scale", "1", "--load", "0.8"]
        runs = ["--max-rate", str(args.max_rate), "--pairs", str(args.pairs), "--iterations", str(args.iterations)]
        code = bubble_fill.main([*case, *runs])
    if code != 0:
        return code
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    print(json.dumps({"check": "gpu", **device, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
