"""bench/train_tokens.py: a tiny quick run trains the small GPT and a Llama-shaped directory over
live services and prints one JSON line with each case's tokens/s, the peak RSS of its stage
workers (each a torch process, so well over 50 MB), its parameter count and a finite loss.

PP=2 x DP=1 and 2 iterations (a warm-up and one timed): the bench's figures and both cases are the
subject, not data parallelism (the e2e tier trains DP=2 against references): two workers a case,
not four, on a 2-core machine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CASES = ("gpt", "llama")
ARGS = ["--quick", "--tiny", "--dp", "1", "--iterations", "2"]


def test_a_tiny_quick_run_reports_tokens_per_second_and_worker_memory_of_both_models() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_tokens.py"), *ARGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,  # only bounds a failure: a tiny run takes well under a minute
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert out["bench"] == "train_tokens"
    assert (out["pp"], out["dp"], out["seq_len"], out["iterations"]) == (2, 1, 32, 2)
    assert out["tokens_per_iteration"] == 1 * out["microbatches"] * out["microbatch_size"] * 32
    assert out["device"] == "cpu" and out["quick"] is True
    for case in CASES:
        assert out[f"tokens_per_s_{case}"] > 0
        assert out[f"tokens_per_s_{case}"] == pytest.approx(
            out["tokens_per_iteration"] / (out[f"iteration_ms_{case}"] / 1000), rel=1e-3
        )
        assert out[f"peak_rss_mb_{case}"] > 50, case  # a process that imported torch
        assert out[f"workers_seen_{case}"] == 2
        assert isinstance(out[f"params_{case}"], int) and out[f"params_{case}"] > 0
        assert math.isfinite(out[f"final_loss_{case}"])
    # the tiny Llama, counted by hand: a 400-id tokenizer padded to 448 rows, an untied head, 2 layers
    # of d 32 with 4 heads over 2 kv heads (kv width 16), SwiGLU of 86, two RMSNorms a layer and one final
    vocab, d, kv, inner = 448, 32, 16, 86
    layer = 2 * d * d + 2 * d * kv + 3 * d * inner + 2 * d
    assert out["params_llama"] == 2 * vocab * d + 2 * layer + d
