"""On a GPU, training and prefill give the CPU's answers (`device.kind`, `shared.model.devices`).

The tests marked `cuda` run only where `torch.cuda.is_available()`; elsewhere they are skipped
with the reason below. Each has a CPU twin that runs the same code path with `device.kind: cpu`,
so the path is exercised on every machine: the prefill's is here, the training's is
`tests/e2e/test_training_correctness.py` (the same PP=2 x DP=2 run against the same reference,
every worker saying it took the CPU), not run twice. Without CUDA, a worker asked for `cuda` must
refuse to start with a clear message (the last test).

Why the GPU is compared with a tolerance and not bit for bit: the same float32 model runs other
kernels there (cuBLAS matrix products with their own blocking, fused scaled-dot-product attention,
parallel reductions in LayerNorm, softmax and cross-entropy, atomic adds in the embedding's
backward), so sums are taken in other orders and round differently, about 1e-7 relative per
operation. AdamW then amplifies those differences a little each step (it normalises each update,
so a parameter whose gradient is near zero can move by up to lr either way). Over a few steps the
losses stay within `LOSS_RTOL` relative of the CPU reference; a wrong device move or a missing
gradient would be off by far more. TF32 is off by default in torch for float32 matrix products, and
nothing here turns it on. The guest model a worker builds runs in bfloat16 on a GPU
(`shared.model.devices.guest_dtype`), so its first tokens are compared with the CPU's float32 ones
within bfloat16's rounding: each among the CPU's top three, at that token's logprob within
`LOGPROB_ATOL_BF16`.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from bubbletea.launcher.train import run_training
from services.stage_worker.train.warm import guest_model
from shared.config.settings import load_settings
from shared.config.spec import parse_spec
from shared.dataplane import kvstore
from shared.model.devices import select_device
from shared.model.prefill import PrefillResult
from shared.model.reference import train_reference_for
from shared.model.tokenizer import encode
from shared.runtime.redis_server import EmbeddedRedis

NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is false (a CPU-only torch build, or no visible GPU)"
#: A test that runs on a GPU: marked `cuda` and skipped cleanly without one.
ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
KINDS = ["cpu", pytest.param("cuda", marks=ON_CUDA)]

#: Relative tolerance of GPU losses against the CPU reference (see the module docstring).
LOSS_RTOL = 1e-3
LOGPROB_ATOL = 1e-4
LOGPROB_ATOL_BF16 = 0.25

TRAIN_SPEC = {
    "name": "devices",
    "datacenters": [{"name": "dc-a", "gpus": 2}, {"name": "dc-b", "gpus": 2}],
    "wan": {"sharing": "temporal", "default": {"latency_ms": 2, "bandwidth_gbps": 1, "connections": 4}},
    "model": {"layers": 4, "d_model": 32, "heads": 4, "seq_len": 16, "vocab": 256, "seed": 3},
    "parallelism": {"pp": 2, "dp": 2, "tp": 1},
    # float32 on the GPU too (bf16 autocast would be off by more than LOSS_RTOL: see the bf16 test)
    "training": {"schedule": "1f1b", "microbatches": 3, "microbatch_size": 2, "iterations": 4, "lr": 3e-3, "seed": 7,
                 "precision": "fp32"},
}  # fmt: skip
#: bf16 autocast keeps about 3 significant digits of the activations: the loss stays this close.
BF16_LOSS_RTOL = 3e-2

PREFILL_SPEC = {
    "datacenters": [{"name": "dc-a", "gpus": 1}],
    "prefill": {"model": {"layers": 4, "d_model": 64, "heads": 4, "seq_len": 64, "vocab": 256, "seed": 11}},
}
PROMPTS = [
    "Hello, world",
    "The quick brown fox jumps over the lazy dog",
    "def f(x):\n    return x + 1",
    "BubbleTea fills pipeline bubbles with prefill",
    "a",
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
async def test_bf16_autocast_on_cuda_trains_close_to_the_fp32_reference(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    training = {**TRAIN_SPEC["training"], "precision": "auto"}  # type: ignore[dict-item]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**TRAIN_SPEC, "device": {"kind": "cuda"}, "training": training}))
    settings = load_settings(path, env={"BUBBLETEA_RUN": f"bf16-{uuid.uuid4().hex[:6]}"})
    result = await run_training(settings, redis_server.url, out=io.StringIO(), progress=False)
    expected, _ = train_reference_for(settings.spec)
    assert result.losses == pytest.approx(expected, rel=BF16_LOSS_RTOL)
    assert result.losses[-1] < result.losses[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
async def test_pp_dp_training_on_the_gpu_matches_the_cpu_reference(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    """Its CPU twin: tests/e2e/test_training_correctness.py (the same run on the CPU, exact)."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**TRAIN_SPEC, "device": {"kind": "cuda"}}))
    settings = load_settings(path, env={"BUBBLETEA_RUN": f"dev-cuda-{uuid.uuid4().hex[:6]}"})
    out = io.StringIO()
    result = await run_training(settings, redis_server.url, out=out, progress=False)

    spec = settings.spec
    expected, _ = train_reference_for(spec)  # on the CPU, in this process
    assert len(result.losses) == len(expected) == spec.training.iterations
    assert result.losses == pytest.approx(expected, rel=LOSS_RTOL)
    # every worker logged the device it took, on the GPU its slot maps to
    chosen = [line for line in out.getvalue().splitlines() if 'msg="device chosen"' in line]
    assert len(chosen) == spec.parallelism.pp * spec.parallelism.dp, out.getvalue()[-3000:]
    assert all("device=cuda" in line and "gpu=" in line for line in chosen), chosen


def prefill_all(device: torch.device) -> list[PrefillResult]:
    """Each prompt prefilled greedily on `device`: the first uninterrupted, every other one run
    two blocks, snapshotted to the wire format (CPU tensors), restored and resumed, as a preempted
    prefill moves between bubbles."""
    spec = parse_spec(PREFILL_SPEC)
    model = guest_model(spec, device)  # as the worker builds it
    assert model.device == device
    results = []
    for i, prompt in enumerate(PROMPTS):
        if i % 2 == 0:
            results.append(model.prefill(encode(prompt), top_logprobs=3))
            continue
        state = model.run_layers(model.start(encode(prompt)), max_layers=2)
        restored = kvstore.restore(kvstore.snapshot(f"p{i}", state), model.layers)
        assert restored.hidden is not None and restored.hidden.device.type == "cpu"
        results.append(model.finish(model.run_layers(restored), top_logprobs=3))
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_on_the_device_returns_the_cpus_first_tokens(kind: str) -> None:
    device = select_device(kind, 0)
    assert device.type == kind
    on_cpu = prefill_all(torch.device("cpu"))
    on_device = prefill_all(device)
    if kind == "cpu":  # the same float32 model: the same answers to the last bit
        assert [(r.token, r.logprob, r.top) for r in on_device] == [(r.token, r.logprob, r.top) for r in on_cpu]
    tol = {"rtol": 1e-4, "atol": 1e-5} if kind == "cpu" else {"rtol": 5e-2, "atol": 5e-2}  # bfloat16 on a GPU
    for a, b in zip(on_device, on_cpu, strict=True):
        top = dict(b.top)
        assert a.token in top and a.logprob == pytest.approx(top[a.token], abs=LOGPROB_ATOL_BF16)
        assert len(a.kv) == len(b.kv) == 4
        for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True):
            torch.testing.assert_close(ka.cpu().float(), kb, **tol)
            torch.testing.assert_close(va.cpu().float(), vb, **tol)
    # the prompts' greedy choices are clear-cut: the top two logprobs differ by far more than rounding
    assert all(r.top[0][1] - r.top[1][1] > 10 * LOGPROB_ATOL for r in on_cpu), [r.top for r in on_cpu]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: device.kind cuda starts here")
def test_a_worker_asked_for_cuda_without_it_refuses_to_start_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"datacenters": [{"name": "a", "gpus": 4}], "device": {"kind": "cuda"}}))
    # Nothing listens on port 1: the worker must stop before it ever talks to Redis.
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0", "BUBBLETEA_CONFIG": str(path)}
    r = subprocess.run(
        [sys.executable, "-m", "services.stage_worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 2, r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert "device.kind is cuda but CUDA is not available" in text and "Traceback" not in text
