"""The data plane: tensors between workers over torch.distributed, rendezvous through Redis."""

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
