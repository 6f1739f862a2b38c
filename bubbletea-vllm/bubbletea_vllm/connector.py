"""`BubbleTeaConnector`: vLLM decodes from KV caches BubbleTea prefilled in training bubbles.

A `KVConnectorBase_V1` in the role ``kv_consumer``, which loads asynchronously. vLLM makes one per
process and tells it its role: in the engine core process it is the scheduler side
(`bubbletea_vllm.scheduler`: which requests load, shipping the loads, freeing caches), in each
model worker the worker side (`bubbletea_vllm.worker`: fetching and writing, reporting loads
done or failed). This class only picks the side and hands each call to it; a call for the other
side's role is a bug in the caller and fails (an ``assert`` would vanish under ``python -O``).

What it adds to vLLM's own accounting: loaded positions count as prefix-cache hits from a peer
(``vllm:prompt_tokens_cached_by_source{source="p2p"}``; vLLM's
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}`` counts them as for any connector),
and its counts (`bubbletea_vllm.stats`) join vLLM's "KV Transfer metrics" log line and its
Prometheus metrics as ``vllm:bubbletea_kv_*``. Its log lines go to vLLM's log, under the logger
``vllm.bubbletea_vllm``.

Tensor parallelism is not supported yet: the connector refuses to start with more than one
tensor-parallel rank rather than load the wrong heads; nor are models with more than one KV cache
group (hybrid attention), which it refuses when vLLM first hands it a load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from bubbletea_vllm.kvclient import DEFAULT_TIMEOUT_S, KvClient
from bubbletea_vllm.metadata import BubbleTeaMetadata, ConnectorContractError
from bubbletea_vllm.scheduler import BubbleTeaScheduler
from bubbletea_vllm.stats import BubbleTeaPromMetrics, BubbleTeaStats
from bubbletea_vllm.worker import BubbleTeaWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")


class BubbleTeaConnector(KVConnectorBase_V1):
    # The cache comes from another machine's memory: a peer, in vLLM's cache-hit sources.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(f"BubbleTeaConnector supports tensor_parallel_size 1, not {tp}")
        role_name = self._kv_transfer_config.kv_role
        if not self._kv_transfer_config.is_kv_consumer:
            raise ValueError(f"BubbleTeaConnector only loads caches: kv_role must be kv_consumer, not {role_name}")
        block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        client = KvClient(timeout_s=float(extra.get("fetch_timeout_s", DEFAULT_TIMEOUT_S)))
        self.scheduler: BubbleTeaScheduler | None = None
        self.worker: BubbleTeaWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = BubbleTeaScheduler(block_size, client)
        else:
            self.worker = BubbleTeaWorker(block_size, client)
        logger.info("BubbleTea connector ready (%s side, block size %d)", role.name.lower(), block_size)

    def _scheduler(self) -> BubbleTeaScheduler:
        if self.scheduler is None:
            raise ConnectorContractError("a scheduler-side call on the worker side's connector")
        return self.scheduler

    def _worker(self) -> BubbleTeaWorker:
        if self.worker is None:
            raise ConnectorContractError("a worker-side call on the scheduler side's connector")
        return self.worker

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    # ---------------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, BubbleTeaMetadata):
            raise ConnectorContractError(f"the connector's metadata is a {type(meta).__name__}, not ours")
        self._worker().start_load_kv(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request's forward passes start only once its whole cache is written

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # a consumer saves nothing

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(sent: none, a consumer sends nothing; received: the loads that ended, well or not)."""
        return None, self._worker().get_finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    # ---------------------------------------------------------------- both sides

    def get_kv_connector_stats(self) -> BubbleTeaStats | None:
        side = self.scheduler or self.worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> BubbleTeaStats:
        return BubbleTeaStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> BubbleTeaPromMetrics:
        return BubbleTeaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        side = self.scheduler or self.worker
        if side is not None:
            side.shutdown()
