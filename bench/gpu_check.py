"""The GPU check: BubbleTea on real compute, ready to run wherever a GPU is (`make gpu-check`).

PP=2 x DP=2 (four workers) with **no device profile at all**: training and prefill count for their
real compute, on the GPU when torch sees one (the workers' slots share whatever GPUs there are,
`shared.model.devices`), at time scale k = 1, BubbleTea on, an open-loop load at 80% of the bubbles'
measured capacity, uncapped unless `--max-rate` says so; the figures of `bench/bubble_fill.py`
(every bubble, every request). It prints the device, the GPU share and the job first and one JSON
line last, with them in it.

* **The job** (`--job`, bench/lib/gpu_job.py): `full`, the default on a GPU: a Llama of hidden 1,024,
  8 layers a stage, 1,024-token sequences, trained with bf16 autocast and serving its own prefill,
  over a 25 Gb/s, 20 ms WAN, with prompt lengths from the Azure 2023 conversation trace; `tiny`,
  the default on a CPU: the same path, small (the smoke test); `small-gpt`: the 64-wide GPT and
  96-token prompts of `bench/bubble_fill.py`.
* **A share of the GPU per worker** (`--gpu-share`, bench/lib/gpu_share.py): with more workers than
  GPUs, `mps` (the default there) starts a CUDA MPS control daemon of the check's own and caps each
  worker at its share of the SMs; `none` leaves them time-sliced. A machine where MPS cannot start
  says so and runs time-sliced.
* `--dump DIR`: every run's spans and dispatcher records, and every bubble that had work and
  stayed empty with its predicted and actual length.
* **The simulator on this device** (always; bench/lib/sim_fit.py): the device's times learned from the
  last pair (training's blocks, step and all-reduce from its spans; a prefill block's fixed part and
  per-token part from its batch reports, in pieces as the workers ran them), the spec simulated with
  them, and its relative error against live on iteration time, bubble fraction and fill (`sim_*`).

    python bench/gpu_check.py                      # 2 pairs of 8 iterations
    python bench/gpu_check.py --quick              # 1 pair of 3 iterations (the smoke test)
    python bench/gpu_check.py --dp 1               # PP=2 x DP=1: two workers (one GPU, or a small CPU)
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import bubble_fill

from bench.lib.gpu_job import SIZES
from bench.lib.gpu_share import CHOICES, CONTROL, Mps, Share, choose


def device_line() -> dict[str, object]:
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return {"device": "cuda", "gpus": names, "torch": torch.__version__, "cuda": torch.version.cuda}
    return {"device": "cpu", "gpus": [], "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, help="training iterations per run; default 8 (--quick: 3)")
    ap.add_argument("--pairs", type=int, help="interleaved off/on pairs; default 2 (--quick: 1)")
    ap.add_argument(
        "--quick", action="store_true", help="one pair of 3 iterations at most 10 requests/s: the smoke test"
    )
    ap.add_argument("--max-rate", type=float, help="requests per real second at most; default none (--quick: 10)")
    ap.add_argument(
        "--dp", type=int, default=2, choices=(1, 2), help="data-parallel replicas, PP=2 x DP workers; default 2"
    )
    ap.add_argument(
        "--job",
        choices=(*sorted(SIZES), "small-gpt"),
        help="what trains and serves: default full where a GPU is, tiny on a CPU (see above)",
    )
    ap.add_argument(
        "--gpu-share", choices=CHOICES, help="mps or none; default mps where workers share a GPU (see above)"
    )
    ap.add_argument("--dump", metavar="DIR", help="write every run's records and its empty bubbles with work into DIR")
    args = ap.parse_args(argv)
    args.iterations = args.iterations or (3 if args.quick else 8)
    args.pairs = args.pairs or (1 if args.quick else 2)
    args.max_rate = args.max_rate or (10.0 if args.quick else None)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    job = args.job or ("full" if gpus else "tiny")
    share = choose(args.gpu_share, gpus=gpus, workers=2 * args.dp, mps_binary=shutil.which(CONTROL) is not None)
    with tempfile.TemporaryDirectory(prefix="gpu-check-mps-") as folder:
        mps = Mps(Path(folder))
        share = mps.start(share)  # before this process touches the GPU: its own measurement is a client too
        try:
            return _check(args, job, share)
        finally:
            mps.stop()


def _check(args: argparse.Namespace, job: str, share: Share) -> int:
    device = device_line()
    print(
        f"gpu-check on {device['device']}: {', '.join(device['gpus']) or 'no GPU'} (torch {device['torch']}); "  # type: ignore[arg-type]
        f"{share.line()}; job {job}",
        file=sys.stderr,
        flush=True,
    )
    out = io.StringIO()
    with redirect_stdout(out):
        case = ["--dp", str(args.dp), "--mode", "real", "--time-scale", "1", "--load", "0.8"]
        runs = ["--pairs", str(args.pairs), "--iterations", str(args.iterations)]
        runs += ["--max-rate", str(args.max_rate)] if args.max_rate else []
        runs += ["--job", job] if job != "small-gpt" else []
        runs += ["--dump", args.dump] if args.dump else []
        runs += ["--sim"]  # the simulator on the device times learned from the last pair: sim_* keys
        code = bubble_fill.main([*case, *runs])
    if code != 0:
        return code
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    head = {"check": "gpu", **device, "gpu_share": share.mode, "gpu_share_why": share.why}
    head |= {"mps_thread_percentage": share.percentage, "job": job}
    print(json.dumps({**head, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
