"""Training throughput on this machine: tokens/s and peak memory per worker, training alone.

Two cases, each one real training run over live services (`bubbletea.launcher.train.run_training`:
a wan_broker and PP x DP stage-worker processes, here PP=2 x DP=2 unless --pp/--dp say otherwise)
on a private embedded redis-server of its own:

* ``gpt``: the project's small GPT (the shape of configs/demo.yaml's model, made a realistic size
  for a CPU: 4 layers, d_model 128, 4 heads, seq_len 128, vocab 256) on its default corpus, the
  standard library's bytes;
* ``llama``: a Llama-shaped Hugging Face directory this bench writes into a temporary folder:
  config.json (model_type llama, 4 layers, hidden_size 128, intermediate_size 344, 4 heads, 2 kv
  heads, SwiGLU, RMSNorm, rotary embeddings, untied head, vocab_size the tokenizer's rounded up
  past a multiple of 64) and no weights, so it is initialised as its family does; its tokenizer.json
  is a byte-level BPE of about 1000 ids trained (`train_bpe_tokenizer`) on this repository's own
  README.md and docs/*.md, which are also its `training.data`.

Both cases use the same sequence length and batch shape (4 microbatches of 2 sequences per replica
per iteration), so their figures compare. Training alone: BubbleTea off (no prefill, no prefill
model loaded), no device profile (no `fwd_ms_per_layer`: every operation takes its real compute
time, nothing is padded), checkpoints off, the WAN in its default mode (`model`) with a fast link
(10 Gb/s, 1 ms one way) so that it does not dominate. `device.kind` is ``cpu`` (``--device auto``:
``auto``, the GPU when torch sees one; each worker on the CPU runs one torch thread).

Figures, per case:

* ``tokens_per_s_*`` = tokens per iteration (dp x microbatches x microbatch_size x seq_len) / the
  steady iteration time (`TrainResult.steady_iteration_s`: the median over iterations, the first,
  a warm-up, left out). ``iteration_ms_*`` is that steady time;
* ``peak_rss_mb_*``: the peak resident set size (``VmHWM`` of /proc/<pid>/status, MB = 1e6 bytes)
  of each stage-worker process, the largest over the workers. A background thread
  (bench/_worker_memory.py) polls /proc every 0.2 s during the run for descendants of this process
  running ``services.stage_worker`` and keeps each one's latest VmHWM (the kernel's own high-water
  mark, so a peak between two polls still counts). On a GPU this is host memory, not GPU memory.
  ``workers_seen_*`` says how many workers the poller saw (PP x DP when it saw all);
* ``params_*``: the model's parameters, counted from its shape by the project's own modules (the
  GPT built whole; the Llama module built on the meta device), each tensor once;
* ``final_loss_*``: the last iteration's loss (mean over replicas of the last stage's loss).

    python bench/train_tokens.py            # 12 iterations per case
    python bench/train_tokens.py --quick    # 5 iterations per case
    python bench/train_tokens.py --tiny     # tiny models (d_model 32, seq_len 32), 3 iterations: a smoke test

Prints a line per case on stderr (and each iteration as it completes), then one JSON object on the
last line of stdout. A run that fails (a worker exits, a loss that is not finite, no worker seen by
the memory poller) ends the bench with exit code 1 and a message naming the case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from _worker_memory import STAGE_WORKER_MODULE, WorkerMemory

ROOT = Path(__file__).resolve().parent.parent
MB = 1_000_000
#: The fast WAN link of both cases (one way latency, capacity).
LINK = {"latency_ms": 1.0, "bandwidth_gbps": 10.0}
CASES = ("gpt", "llama")


@dataclass(frozen=True)
class Shape:
    """The models' shape and the batch, shared by both cases (the Llama's extras aside)."""

    layers: int = 4
    d_model: int = 128
    heads: int = 4
    kv_heads: int = 2  # llama only: grouped-query attention, two query heads per kv head
    intermediate: int = 344  # llama only: the SwiGLU width (about 8/3 x d_model)
    seq_len: int = 128
    gpt_vocab: int = 256  # bytes
    bpe_vocab: int = 1000  # the llama's tokenizer, trained here
    microbatches: int = 4
    microbatch_size: int = 2


FULL = Shape()
TINY = Shape(layers=2, d_model=32, heads=4, kv_heads=2, intermediate=86, seq_len=32, bpe_vocab=400)


class CaseFailed(RuntimeError):
    """A case could not be measured: the message names it and says why."""


# --- the two cases -------------------------------------------------------------------------------


def datacenters(pp: int, dp: int) -> list[dict[str, Any]]:
    """Two DCs holding the first ceil(pp/2) and the last floor(pp/2) stages (one DC when pp is 1)."""
    first = (pp + 1) // 2
    dcs = [{"name": "dc-a", "gpus": first * dp}]
    if pp > first:
        dcs.append({"name": "dc-b", "gpus": (pp - first) * dp})
    return dcs


def base_spec(case: str, shape: Shape, pp: int, dp: int, iterations: int, device: str) -> dict[str, Any]:
    return {
        "name": f"train-tokens-{case}",
        "datacenters": datacenters(pp, dp),
        "wan": {"default": dict(LINK)},
        "model": {
            "layers": shape.layers,
            "d_model": shape.d_model,
            "heads": shape.heads,
            "seq_len": shape.seq_len,
            "vocab": shape.gpt_vocab,
            "seed": 0,
        },
        "parallelism": {"pp": pp, "dp": dp, "tp": 1},
        "training": {
            "schedule": "1f1b",
            "microbatches": shape.microbatches,
            "microbatch_size": shape.microbatch_size,
            "iterations": iterations,
            "lr": 3.0e-4,
            "seed": 0,
            "checkpoint_every": 0,
        },
        "device": {"kind": device},  # no profile: real compute time
        "bubbletea": {"enabled": False},
    }


def corpus_files() -> list[Path]:
    """Text this repository ships: its README and the top-level docs."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or len(files) < 2:
        raise CaseFailed(f"llama: the corpus files are missing: {missing or 'docs/*.md'}")
    return files


def llama_config(shape: Shape, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": shape.layers,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max(shape.seq_len, 256),
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "eos_token_id": 0,  # train_bpe_tokenizer's <|endoftext|>
        "torch_dtype": "float32",
    }


def write_llama_dir(directory: Path, shape: Shape) -> tuple[list[Path], int]:
    """A weightless Llama directory: tokenizer.json trained on the repo's docs, and config.json.
    Returns the training files and the tokenizer's id count."""
    from tokenizers import Tokenizer

    from shared.model.corpus import train_bpe_tokenizer

    files = corpus_files()
    texts = [f.read_text(encoding="utf-8") for f in files]
    path = train_bpe_tokenizer(texts, shape.bpe_vocab, directory / "tokenizer.json")
    ids = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    vocab = (ids // 64 + 1) * 64  # a bit above the tokenizer's, as real models pad their embedding
    (directory / "config.json").write_text(json.dumps(llama_config(shape, vocab), indent=2) + "\n")
    return files, ids


def count_params(spec: Any) -> int:
    """Parameters of the spec's model, each tensor once, built by the project's own modules."""
    import torch

    from shared.config.model_info import info_from_config, read_config
    from shared.model.checkpoint import FAMILIES
    from shared.model.gpt import build_full
    from shared.model.shape import GPTConfig

    if spec.training.model is None:
        model: torch.nn.Module = build_full(GPTConfig.from_spec(spec.model), spec.model.seed)
    else:  # the family module builds its parameters on the meta device: shapes only, no memory
        config = read_config(spec.training.model)
        model = FAMILIES[config["model_type"]].from_config(config, info_from_config(config))
    return sum(p.numel() for p in model.parameters())


def run_case(case: str, raw: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Train `raw` once over live services on a private Redis; its figures."""
    from bubbletea.launcher.train import run_training
    from shared.config.settings import load_settings
    from shared.runtime.redis_server import EmbeddedRedis

    path = workdir / f"{case}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    settings = load_settings(path, env={"BUBBLETEA_RUN": f"train-tokens-{case}-{os.getpid()}-{time.time_ns()}"})
    spec = settings.spec
    params = count_params(spec)

    async def train() -> Any:
        async with EmbeddedRedis() as server:
            return await run_training(settings, server.url, out=sys.stderr, progress=True, quiet=True, label=case)

    t0 = time.perf_counter()
    with WorkerMemory(spec.parallelism.pp * spec.parallelism.dp) as memory:
        result = asyncio.run(train())
    elapsed = time.perf_counter() - t0

    if not memory.peaks:
        raise CaseFailed(f"{case}: the memory poller saw no {STAGE_WORKER_MODULE} process under pid {os.getpid()}")
    final_loss = result.losses[-1]
    if not all(math.isfinite(x) for x in result.losses):
        raise CaseFailed(f"{case}: a loss is not finite: {result.losses}")
    tokens = result.tokens_per_iteration
    steady = result.steady_iteration_s()
    peak = max(memory.peaks.values()) / MB
    row = {
        "tokens_per_s": tokens / steady,
        "iteration_ms": steady * 1000,
        "peak_rss_mb": peak,
        "workers_seen": len(memory.peaks),
        "params": params,
        "final_loss": final_loss,
        "first_loss": result.losses[0],
        "seconds": elapsed,
    }
    per_worker = ", ".join(f"{v / MB:.0f}" for v in sorted(memory.peaks.values()))
    print(
        f"{case:<6} {params / 1e6:6.3f} M params  {tokens} tokens/iteration  steady {row['iteration_ms']:8.1f} ms "
        f"-> {row['tokens_per_s']:9.1f} tokens/s  peak RSS per worker {peak:6.1f} MB "
        f"(workers: {per_worker})  loss {result.losses[0]:.3f} -> {final_loss:.3f}  "
        f"({len(result.losses)} iterations in {elapsed:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return row


def device_name(kind: str) -> str:
    if kind == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally`: workers and redis-servers stop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 iterations per case instead of 12")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="tiny models (2 layers, d_model 32, seq_len 32, a 400-id tokenizer) and 3 iterations: a smoke test",
    )
    ap.add_argument("--iterations", type=int, default=None, metavar="N", help="iterations per case (at least 2)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel replicas (default 2)")
    ap.add_argument(
        "--device",
        choices=("cpu", "auto"),
        default="cpu",
        help="device.kind of the workers: cpu (default), or auto (the GPU when torch sees one)",
    )
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which cases to run (default both)")
    args = ap.parse_args(argv)
    shape = TINY if args.tiny else FULL
    iterations = args.iterations if args.iterations is not None else 3 if args.tiny else 5 if args.quick else 12
    if iterations < 2:
        ap.error(f"--iterations must be at least 2 (the first is a warm-up), got {iterations}")
    if args.pp < 1 or args.dp < 1:
        ap.error("--pp and --dp must be at least 1")
    if args.pp > shape.layers:
        ap.error(f"--pp {args.pp} is more than the models' {shape.layers} layers")
    signal.signal(signal.SIGTERM, _terminate)
    started = time.perf_counter()
    device = device_name(args.device)
    tokens = args.dp * shape.microbatches * shape.microbatch_size * shape.seq_len
    print(
        f"training alone on {device}: PP={args.pp} x DP={args.dp}, {tokens} tokens per iteration, "
        f"{iterations} iterations per case",
        file=sys.stderr,
        flush=True,
    )
    out: dict[str, Any] = {"bench": "train_tokens"}
    try:
        with tempfile.TemporaryDirectory(prefix="train-tokens-") as tmp:
            work = Path(tmp)
            for case in args.cases:
                raw = base_spec(case, shape, args.pp, args.dp, iterations, args.device)
                if case == "llama":
                    model_dir = work / "llama"
                    model_dir.mkdir()
                    files, ids = write_llama_dir(model_dir, shape)
                    print(f"llama: tokenizer of {ids} ids trained on {len(files)} files of this repo", file=sys.stderr)
                    raw["training"]["model"] = str(model_dir)
                    raw["training"]["data"] = [str(f) for f in files]
                try:
                    row = run_case(case, raw, work)
                except (CaseFailed, KeyboardInterrupt, SystemExit):
                    raise
                except Exception as exc:  # a worker that failed, a bad spec, ...: name the case
                    raise CaseFailed(f"{case}: {type(exc).__name__}: {exc}") from exc
                for key, value in row.items():
                    out[f"{key}_{case}"] = round(value, 4) if isinstance(value, float) else value
    except CaseFailed as exc:
        print(f"train_tokens: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: workers and redis-servers stopped", file=sys.stderr)
        return 130
    out.update(
        pp=args.pp,
        dp=args.dp,
        seq_len=shape.seq_len,
        microbatches=shape.microbatches,
        microbatch_size=shape.microbatch_size,
        tokens_per_iteration=tokens,
        iterations=iterations,
        device=device,
        quick=args.quick,
        tiny=args.tiny,
        seconds=round(time.perf_counter() - started, 1),
    )
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
