"""Where a stage worker computes: the CPU or the GPU its slot maps to (`device.kind` in the spec).

* ``cpu``: always the CPU (what every test on a machine without a GPU runs).
* ``cuda``: a GPU; a worker on a machine where torch sees none refuses to start (`DeviceError`,
  a sentence saying why: a CPU build of torch, or no visible GPU).
* ``auto`` (the default): ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.

The mapping, a pure function (`gpu_index`): slot (replica r, stage k) of a PP-stage pipeline has
the index ``r * pp + k`` (`slot_index`: a replica's stages are neighbours), and takes GPU
``slot_index % device_count`` among the GPUs torch sees. torch sees only the GPUs listed in
``CUDA_VISIBLE_DEVICES`` (when set), renumbered from 0 in that order, so that variable restricts
and reorders what workers take; nothing here reads it. With at least PP x DP visible GPUs every
worker has one of its own; with fewer, workers share them round-robin.
"""

from __future__ import annotations

from typing import Literal

import torch

DeviceKind = Literal["auto", "cpu", "cuda"]
KINDS: tuple[DeviceKind, ...] = ("auto", "cpu", "cuda")


class DeviceError(RuntimeError):
    """The spec asks for a device this machine cannot provide; the message says why and what to do."""


#: CUDA errors that poison the process's context: every later call on the device fails too
#: (CUDA's documentation: "sticky" errors, which only a new process clears).
STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ECC error",
    "hardware stack error",
)


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """Whether `exc` is a CUDA error after which the device cannot be used by this process again: the
    worker must stop and let recovery replace it, not carry on (training over a dead context)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "CUDA" in text and any(s in text for s in STICKY_CUDA_ERRORS)


def guest_dtype(device: torch.device, *, bf16_supported: bool = True) -> torch.dtype:
    """The dtype the guest (prefill) model computes in on `device`: bfloat16 on a GPU that has it
    (half the weights' and KV caches' memory and time of float32; its logits are sampled in float32),
    float32 elsewhere (on the CPU every answer stays bit-equal to what it always was)."""
    return torch.bfloat16 if device.type == "cuda" and bf16_supported else torch.float32


def slot_index(replica: int, stage: int, pp: int) -> int:
    """The slot's index among all PP x DP slots: replica-major, so a replica's stages are neighbours."""
    if pp < 1 or not 0 <= stage < pp or replica < 0:
        raise ValueError(f"no slot (replica {replica}, stage {stage}) in a {pp}-stage pipeline")
    return replica * pp + stage


def gpu_index(slot: int, device_count: int) -> int:
    """The visible GPU (0-based, as torch numbers them) that slot index `slot` takes."""
    if device_count < 1:
        raise ValueError(f"device_count must be >= 1, got {device_count}")
    if slot < 0:
        raise ValueError(f"slot index must be >= 0, got {slot}")
    return slot % device_count


def gpu_sharers(slot: int, slots: int, device_count: int) -> int:
    """How many of `slots` slot indices take the GPU that slot index `slot` takes (`gpu_index`)."""
    return len(range(gpu_index(slot, device_count), slots, device_count))


def resolve_kind(kind: str, *, cuda_available: bool, cuda_build: str | None = None) -> Literal["cpu", "cuda"]:
    """``cpu`` or ``cuda`` for the spec's `kind`; `DeviceError` for ``cuda`` without CUDA.

    `cuda_build` is ``torch.version.cuda`` (None for a CPU build); it only makes the message precise.
    """
    if kind not in KINDS:
        raise ValueError(f"device kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "cpu" or (kind == "auto" and not cuda_available):
        return "cpu"
    if not cuda_available:
        why = (
            "this torch is a CPU-only build (torch.version.cuda is None)"
            if cuda_build is None
            else f"torch (built for CUDA {cuda_build}) sees no GPU: check the driver, CUDA_VISIBLE_DEVICES "
            "and, in a container, the GPU reservation (compose: `gpus: all`)"
        )
        raise DeviceError(
            f"device.kind is cuda but CUDA is not available: {why}. Install a CUDA build of torch "
            "(docker: --build-arg TORCH=cu128), or set device.kind to auto or cpu to run on the CPU"
        )
    return "cuda"


def select_device(
    kind: str,
    slot: int,
    *,
    cuda_available: bool | None = None,
    device_count: int | None = None,
) -> torch.device:
    """The device of the worker whose slot index is `slot` (see `slot_index`).

    `cuda_available` and `device_count` default to what torch reports; tests pass them in.
    """
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if resolve_kind(kind, cuda_available=available, cuda_build=torch.version.cuda) == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if device_count is None else device_count
    return torch.device("cuda", gpu_index(slot, count))


def check_kind(kind: str) -> Literal["cpu", "cuda"]:
    """What `kind` resolves to on this machine (`DeviceError` for ``cuda`` without CUDA); call it at
    start-up, before anything is leased, so a wrong spec fails at once and clearly."""
    return resolve_kind(kind, cuda_available=torch.cuda.is_available(), cuda_build=torch.version.cuda)


def describe(device: torch.device) -> dict[str, str]:
    """Log fields naming the device: ``device`` and, for a GPU, its ``gpu`` name."""
    if device.type != "cuda":
        return {"device": str(device)}
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device)}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); nothing on the CPU.

    A compute step ends with this, so its span and any profile padding measure the GPU's time,
    not the time to launch its kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
