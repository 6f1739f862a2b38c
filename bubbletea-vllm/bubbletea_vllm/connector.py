"""`BubbleTeaConnector`: vLLM decodes from KV caches BubbleTea prefilled in training bubbles.

A `KVConnectorBase_V1` in the role ``kv_consumer``. Per request whose ``kv_transfer_params``
carry a BubbleTea handle (`bubbletea_vllm.handle`):

scheduler side (vLLM's engine core process)
    `get_num_new_matched_tokens` reports the prompt positions the cache holds beyond what vLLM
    already has (its own prefix cache may hold a head of them), so vLLM schedules no compute for
    them; `update_state_after_alloc` notes the load; `build_connector_meta` hands the worker the
    request's block ids, its prompt and the range to load; `request_finished` frees the cache on
    its holder (in a thread, off the scheduler's path), whether the request ended well or not.

worker side (each model worker)
    `start_load_kv`, before the forward pass that first schedules the request, fetches the
    cache from its holder (`kvclient`: one kept connection per holder), checks that it was
    computed for this prompt and this model's shape, and writes every layer's keys and values into
    the request's blocks through the attention backend's own ``do_kv_cache_update`` (`layout`).
    The load is synchronous: the forward pass that follows reads the cache.

A cache that cannot be loaded (expired, freed, its holder gone, another prompt's, another model's)
is logged with the reason and its blocks are reported by `get_block_ids_with_load_errors`; under
vLLM's default ``kv_load_failure_policy: fail`` the request then ends with an error, under
``recompute`` vLLM computes the prompt itself. Both are counted (`stats`), and a summary line is
logged every `LOG_EVERY` loads. Tensor parallelism is not supported yet: the connector refuses to
start with more than one tensor-parallel rank rather than load the wrong heads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from bubbletea_vllm.handle import BadCache, Handle, check, layer_index, metadata, parse_handle
from bubbletea_vllm.kvclient import KvClient, KvUnavailable
from bubbletea_vllm.layout import CacheFile, slot_mapping

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("bubbletea_vllm")
if not log.handlers:  # vLLM configures its own loggers only: make ours visible beside them
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [bubbletea_vllm] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)
    log.propagate = False

#: A summary of the counters is logged every this many loads (and at shutdown).
LOG_EVERY = 100


@dataclass
class Load:
    """One request's cache to load: positions [start, end) into `block_ids`."""

    req_id: str
    handle: Handle
    prompt: list[int]  # the request's tokens [0, end), to check the cache against
    start: int
    end: int
    block_ids: list[int]


@dataclass
class BubbleTeaMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


@dataclass
class Stats:
    """What the connector did, in this process."""

    loads: int = 0  # caches loaded into vLLM's blocks
    tokens_loaded: int = 0  # prompt positions vLLM did not compute
    failures: int = 0  # caches that could not be loaded (the request failed or recomputed)
    fallbacks: int = 0  # requests with a BubbleTea handle but no cache to load: vLLM computes the prompt
    frees: int = 0  # caches freed on their holder
    load_ms: float = 0.0  # time spent fetching and writing

    def line(self) -> str:
        per = self.load_ms / self.loads if self.loads else 0.0
        return (
            f"loads={self.loads} tokens_loaded={self.tokens_loaded} failures={self.failures} "
            f"fallbacks={self.fallbacks} frees={self.frees} load_ms_mean={per:.2f}"
        )


class BubbleTeaConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(f"BubbleTeaConnector supports tensor_parallel_size 1, not {tp}")
        self.block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.client = KvClient(timeout_s=float(extra.get("fetch_timeout_s", 10.0)))
        self.stats = Stats()
        self._pending: dict[str, Load] = {}  # scheduler: loads noted, not yet handed to a worker
        self._errors: set[int] = set()  # worker: blocks of loads that failed this step
        self._frees: queue.Queue[tuple[str, str]] = queue.Queue()
        self._freer: threading.Thread | None = None
        log.info("BubbleTea connector ready (%s, block size %d)", role.name.lower(), self.block_size)

    # ---------------------------------------------------------------- scheduler side

    def _handle(self, request: Request) -> Handle | None:
        try:
            return parse_handle(request.kv_transfer_params)
        except BadCache as exc:
            self.stats.fallbacks += 1
            log.warning("request %s: %s; vLLM computes the prompt itself", request.request_id, exc)
            request.kv_transfer_params = None  # said once, not at every scheduling attempt
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        h = self._handle(request)
        if h is None:
            return 0, False
        end = h.loadable(len(request.prompt_token_ids or []))
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        h = self._handle(request)
        if h is None:
            return
        prompt = list(request.prompt_token_ids or [])
        end = h.loadable(len(prompt))
        self._pending[request.request_id] = Load(
            req_id=request.request_id,
            handle=h,
            prompt=prompt[:end],
            start=end - num_external_tokens,
            end=end,
            block_ids=[],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = BubbleTeaMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after a preemption: all blocks anew
            load = self._pending.pop(req_id, None)
            if load is not None and cached.new_block_ids[i] is not None:
                load.block_ids = list(cached.new_block_ids[i][0])
                meta.loads.append(load)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        try:
            h = parse_handle(request.kv_transfer_params)
        except BadCache:
            h = None
        if h is not None:
            self._free_later(h)
        return False, None

    def _free_later(self, h: Handle) -> None:
        if self._freer is None:
            self._freer = threading.Thread(target=self._free_loop, name="bubbletea-kv-free", daemon=True)
            self._freer.start()
        self._frees.put((h.holder, h.key))

    def _free_loop(self) -> None:
        while True:
            holder, key = self._frees.get()
            if self.client.free(holder, key):
                self.stats.frees += 1

    # ---------------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, BubbleTeaMetadata)
        for load in meta.loads:
            t0 = time.perf_counter()
            try:
                self._load(load, forward_context)
            except (KvUnavailable, BadCache) as exc:
                self.stats.failures += 1
                self._errors.update(load.block_ids)
                log.error("request %s: the BubbleTea KV cache was not loaded: %s", load.req_id, exc)
                continue
            self.stats.loads += 1
            self.stats.tokens_loaded += load.end - load.start
            self.stats.load_ms += (time.perf_counter() - t0) * 1000
            if self.stats.loads % LOG_EVERY == 0:
                log.info("BubbleTea connector: %s", self.stats.line())

    def _load(self, load: Load, forward_context: ForwardContext) -> None:
        data = self.client.fetch(load.handle.holder, load.handle.key)
        check(metadata(data), load.handle, load.prompt, load.end)
        cache = CacheFile(data)
        slots: torch.Tensor | None = None
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            impl: Any = getattr(layer, "impl", None)
            if not isinstance(kv, torch.Tensor) or kv.numel() == 0 or not hasattr(impl, "do_kv_cache_update"):
                continue  # not an attention layer with a paged cache
            i = layer_index(name)
            cache.check_shape(i, layer.num_kv_heads, layer.head_size)
            if slots is None:
                slots = slot_mapping(load.block_ids, self.block_size, load.start, load.end).to(kv.device)
            k, v = cache.rows(i, load.start, load.end, kv.dtype)
            impl.do_kv_cache_update(layer, k.to(kv.device), v.to(kv.device), kv, slots)
        if slots is None:
            raise BadCache("this model has no attention layer with a paged KV cache to load into")
        log.debug("request %s: loaded positions %d..%d from %s", load.req_id, load.start, load.end, load.handle.holder)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # a consumer saves nothing

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def shutdown(self) -> None:
        log.info("BubbleTea connector (%s) stopping: %s", self.role.name.lower(), self.stats.line())
        self.client.close()
