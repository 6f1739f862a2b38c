"""Tensors on the wire as dtype + shape + raw bytes: exact round trips, never pickle.

Only the dtypes listed in `_DTYPES` are accepted, on both sides; anything else is a `WireError`.
"""

from __future__ import annotations

import ctypes
import math
from typing import Final

import torch

from shared.wire import TensorBlob, WireError

__all__ = ["TensorBlob", "dtype_name", "from_blob", "to_blob", "torch_dtype"]


_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: Final[dict[torch.dtype, str]] = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; `WireError` for one that cannot travel."""
    name = _NAMES.get(dtype)
    if name is None:
        raise WireError(f"dtype {dtype} cannot go on the wire; supported: {', '.join(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name; `WireError` for an unknown one."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise WireError(f"unknown tensor dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return dtype


def to_blob(tensor: torch.Tensor) -> TensorBlob:
    """Snapshot a tensor (any device, any layout) into a `TensorBlob`."""
    name = dtype_name(tensor.dtype)
    t = tensor.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    # One copy straight out of the tensor's memory: works for bfloat16, which numpy lacks,
    # and needs no numpy at all (the CPU torch wheel does not depend on it).
    data = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
    return TensorBlob(dtype=name, shape=tuple(t.shape), data=data)


def from_blob(blob: TensorBlob) -> torch.Tensor:
    """Rebuild the tensor (on CPU, writable, owning its memory); `WireError` if inconsistent."""
    dtype = torch_dtype(blob.dtype)
    if any(d < 0 for d in blob.shape):
        raise WireError(f"negative dimension in tensor shape {list(blob.shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(blob.shape) * itemsize
    if len(blob.data) != expected:
        raise WireError(
            f"tensor of dtype {blob.dtype} and shape {list(blob.shape)} needs {expected} bytes, got {len(blob.data)}"
        )
    if expected == 0:
        return torch.empty(blob.shape, dtype=dtype)
    # bytearray: a private, writable copy, so the tensor never aliases the message buffer.
    return torch.frombuffer(bytearray(blob.data), dtype=dtype).reshape(blob.shape)
