"""What the scheduler side hands the workers each step (the loads to start), and the error either
side raises when vLLM breaks the contract the connector relies on."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from bubbletea_vllm.handle import Handle
from bubbletea_vllm.layout import blocks_written


class ConnectorContractError(RuntimeError):
    """vLLM did something its connector API (as of 0.32) says it does not: stop rather than guess
    (the API is experimental; a change must fail loudly, not drop a load)."""


@dataclass
class Load:
    """One request's cache to load: positions [start, end) into `block_ids` (the request's blocks,
    all of them, in order: position p lives in block ``block_ids[p // block_size]``)."""

    req_id: str
    handle: Handle
    prompt: list[int]  # the request's tokens [0, end), to check the cache against
    start: int
    end: int
    block_ids: list[int]

    def blocks_loaded(self, block_size: int) -> set[int]:
        """The blocks this load writes: what vLLM must be told failed if it fails."""
        return blocks_written(self.block_ids, block_size, self.start, self.end)


@dataclass
class BubbleTeaMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
