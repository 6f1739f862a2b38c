"""The data plane: tensors between workers over torch.distributed, rendezvous through Redis; and
finished KV caches from the workers to decode services over plain TCP (`shared.dataplane.kv`).

The torch names below are loaded on first use, so `shared.dataplane.kv` (torch-free: the front
door and decode clients import it) does not pull torch in with its package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.dataplane.plane import (
        DataPlane,
        GroupSpec,
        PairSpec,
        PlaneError,
        chunks_of,
        in_thread,
        tag_of,
    )

__all__ = ["DataPlane", "GroupSpec", "PairSpec", "PlaneError", "chunks_of", "in_thread", "tag_of"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("shared.dataplane.plane"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
