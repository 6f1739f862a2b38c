"""Prefill blocks from CUDA graphs against eager ones, on the GPU check's full Llama (a GPU only).

Whether `bubbletea.cuda_graphs` should be on is a measurement: a graph saves each block's kernel
launches, which matter where Python launches kernels slower than the GPU runs them (small blocks,
a small model), and nothing where a block is a few large kernels. Per prompt length, the whole
prefill run as a worker runs it (pieces of `bubbletea.piece_tokens`' GPU default, on the prefill's
low-priority stream), eager and graphed, timed on the host clock around a wait on the stream (the
time a bubble would hold it), the median of `--reps` after one warm-up (which captures the graphs).

    python bench/prefill_graphs.py              # on a GPU: a table, and one JSON line last
    python bench/prefill_graphs.py --reps 50

On a machine without a GPU it says so and prints a JSON line with `skipped`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import torch

from bench.lib.gpu_job import SIZES, make_model
from shared.model.checkpoint import load_causal_lm
from shared.model.prefill import PrefillModel
from shared.policies.fill import GPU_PIECE_TOKENS

LENGTHS = (16, 64, 128, 256, 512, 1024)


def timed(model: PrefillModel, prompt: list[int], reps: int) -> float:
    """Median ms of a whole prefill of `prompt` in pieces, to its first token's logits on the host."""
    times = []
    for _ in range(reps + 1):  # the first: warm-up (and the graphs' capture)
        t0 = time.perf_counter()
        state = model.start(prompt)
        while not state.done:
            model.run_piece(state, GPU_PIECE_TOKENS)
        model.finish(state)
        model.lane.wait()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="timed prefills per prompt length and arm; default 20")
    ap.add_argument("--quick", action="store_true", help="5 prefills per prompt length and arm (make bench)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 5
    if not torch.cuda.is_available():
        print("prefill_graphs: no GPU here (torch.cuda.is_available() is false): nothing to measure", file=sys.stderr)
        print(json.dumps({"bench": "prefill_graphs", "skipped": "no GPU"}))
        return 0
    dev = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = make_model(SIZES["full"], Path(tmp), pp=2)
        eager = PrefillModel(load_causal_lm(directory)).place(dev)
        graphed = PrefillModel(load_causal_lm(directory)).place(dev).use_graphs()
    rows = []
    for n in LENGTHS:
        prompt = [(31 * i) % eager.info.vocab for i in range(n)]
        e, g = timed(eager, prompt, args.reps), timed(graphed, prompt, args.reps)
        rows.append({"tokens": n, "eager_ms": round(e, 3), "graphed_ms": round(g, 3), "speedup": round(e / g, 3)})
        print(f"{n:>6} tokens  eager {e:8.3f} ms  graphed {g:8.3f} ms  x{e / g:.2f}", file=sys.stderr)
    result = {
        "bench": "prefill_graphs",
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "model": "llama-full (hidden 1024, 16 layers, float32)",
        "piece_tokens": GPU_PIECE_TOKENS,
        "reps": args.reps,
        "rows": rows,
        "speedup_median": statistics.median(r["speedup"] for r in rows),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
