"""Device choice (`shared.model.devices`): the slot-to-GPU mapping as a pure function, and the errors.

No GPU is needed: `cuda_available` and `device_count` are passed in.
"""

from __future__ import annotations

import pytest
import torch

from services.stage_worker.train.trainer import StageTrainer
from shared.config.spec import ConfigError, parse_spec
from shared.dataplane.tensors import from_blob, to_blob
from shared.model.data import ByteCorpus
from shared.model.devices import (
    DeviceError,
    check_kind,
    describe,
    gpu_index,
    resolve_kind,
    select_device,
    slot_index,
    synchronize,
)

DC = [{"name": "a", "gpus": 4}]


def test_the_spec_field_defaults_to_auto_and_takes_only_the_three_kinds() -> None:
    assert parse_spec({"datacenters": DC}).device.kind == "auto"
    for kind in ("auto", "cpu", "cuda"):
        assert parse_spec({"datacenters": DC, "device": {"kind": kind}}).device.kind == kind
    with pytest.raises(ConfigError, match=r"device\.kind.*allowed: auto, cpu, cuda"):
        parse_spec({"datacenters": DC, "device": {"kind": "tpu"}})


def test_slot_index_is_replica_major() -> None:
    pp, dp = 3, 2
    indices = [slot_index(r, k, pp) for r in range(dp) for k in range(pp)]
    assert indices == list(range(pp * dp))  # every slot once, a replica's stages side by side
    assert slot_index(1, 0, pp) == 3
    for bad in ((0, 3, 3), (-1, 0, 3), (0, 0, 0)):
        with pytest.raises(ValueError):
            slot_index(*bad)


@pytest.mark.parametrize(
    ("slots", "count", "expected"),
    [
        (4, 4, [0, 1, 2, 3]),  # a GPU each
        (4, 8, [0, 1, 2, 3]),  # spare GPUs stay idle
        (4, 2, [0, 1, 0, 1]),  # fewer GPUs than workers: shared round-robin
        (4, 1, [0, 0, 0, 0]),  # CUDA_VISIBLE_DEVICES=3: every worker on the one visible GPU (cuda:0)
        (6, 4, [0, 1, 2, 3, 0, 1]),
    ],
)
def test_gpu_index_is_the_slot_index_modulo_the_visible_gpus(slots: int, count: int, expected: list[int]) -> None:
    assert [gpu_index(s, count) for s in range(slots)] == expected


def test_gpu_index_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="device_count"):
        gpu_index(0, 0)
    with pytest.raises(ValueError, match="slot index"):
        gpu_index(-1, 2)


def test_select_device_follows_the_kind_and_the_mapping() -> None:
    assert select_device("cpu", 5, cuda_available=True, device_count=8) == torch.device("cpu")
    assert select_device("auto", 5, cuda_available=False, device_count=0) == torch.device("cpu")
    assert select_device("auto", 5, cuda_available=True, device_count=2) == torch.device("cuda", 1)
    assert select_device("cuda", 6, cuda_available=True, device_count=4) == torch.device("cuda", 2)


def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match=r"CPU-only build.*device\.kind to auto or cpu"):
        resolve_kind("cuda", cuda_available=False, cuda_build=None)
    with pytest.raises(DeviceError, match=r"built for CUDA 12\.8\) sees no GPU.*CUDA_VISIBLE_DEVICES"):
        resolve_kind("cuda", cuda_available=False, cuda_build="12.8")
    with pytest.raises(DeviceError):
        select_device("cuda", 0, cuda_available=False)
    with pytest.raises(ValueError, match="one of auto, cpu, cuda"):
        resolve_kind("gpu", cuda_available=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks this machine's CPU-only answers")
def test_this_machine_without_cuda() -> None:
    assert check_kind("auto") == check_kind("cpu") == "cpu"
    with pytest.raises(DeviceError):
        check_kind("cuda")
    assert select_device("auto", 3) == torch.device("cpu")
    assert describe(torch.device("cpu")) == {"device": "cpu"}
    synchronize(torch.device("cpu"))  # nothing to wait for


def test_the_trainer_on_an_explicit_cpu_device_is_bit_identical_to_the_default() -> None:
    """The device moves are no-ops on the CPU: one PP=2 x DP=2 step on stage 0 of replica 1 gives
    the same activation, gradients and weights with `device=cpu` as with no device at all."""
    spec = parse_spec(
        {
            "datacenters": DC,
            "model": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
            "parallelism": {"pp": 2, "dp": 2},
            "training": {"microbatches": 1, "microbatch_size": 2},
        }
    )
    corpus = ByteCorpus(torch.arange(256, dtype=torch.uint8).repeat(8))
    results = []
    for device in (None, torch.device("cpu")):
        tr = StageTrainer(spec, 1, 0, corpus, device)
        act = tr.forward(0, 0, None)
        assert act is not None and act.device.type == "cpu"
        grad = torch.full_like(act, 0.01)
        assert tr.backward(0, from_blob(to_blob(grad))) is None  # stage 0 sends no gradient back
        mine = tr.flat_grads()
        tr.load_mean([mine * 0.5, mine])  # as the all-reduce does, replica order
        tr.step(0)
        results.append((act, mine, torch.cat([p.detach().reshape(-1) for p in tr.params])))
    (a0, g0, w0), (a1, g1, w1) = results
    assert torch.equal(a0, a1) and torch.equal(g0, g1) and torch.equal(w0, w1)
