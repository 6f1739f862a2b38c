"""The connector's scheduler side, in vLLM's engine core process: which requests load a cache, and
when a cache can be freed.

Per request whose ``kv_transfer_params`` carry a BubbleTea handle:

* `get_num_new_matched_tokens`: the prompt positions the cache holds beyond those vLLM already has
  (its prefix cache may hold a head of them), loaded asynchronously: vLLM allocates their blocks
  and parks the request in WAITING_FOR_REMOTE_KVS until a worker reports the load finished;
* `update_state_after_alloc`: notes the load with the request's blocks, once vLLM allocated them;
* `build_connector_meta`: ships every noted load to the workers, this step;
* `request_finished`: frees the cache on its holder, off the scheduler's path, however the request
  ended (done, aborted, failed).

A request preempted after its load is asked about again when vLLM resumes it: its cache is still
on its holder (freed only at the request's end), so it loads again, into its new blocks. A request
whose load failed is not offered its cache again (`update_connector_output` learns of the failure):
under ``kv_load_failure_policy: recompute`` vLLM then computes the prompt itself rather than try
the same cache over and over.

vLLM's connector API is experimental; where it could change under us, this side checks what it
relies on and raises rather than drop a load silently (`ConnectorContractError`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from bubbletea_vllm.handle import BadCache, Handle, parse_handle
from bubbletea_vllm.holders import HolderQueues
from bubbletea_vllm.kvclient import KvClient
from bubbletea_vllm.metadata import BubbleTeaMetadata, ConnectorContractError, Load
from bubbletea_vllm.stats import SCHEDULER_SIDE, BubbleTeaStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")


class BubbleTeaScheduler:
    """The scheduler side's state: loads noted and not yet shipped, frees under way, counts."""

    def __init__(self, block_size: int, client: KvClient) -> None:
        self.block_size = block_size
        self.client = client
        self.pending: dict[str, Load] = {}  # noted in update_state_after_alloc, shipped by build_connector_meta
        self.requests: dict[str, Request] = {}  # the requests of the loads noted or under way
        self.shipped: dict[str, set[int]] = {}  # loads under way on the workers: the blocks each writes
        self.failed: set[str] = set()  # live requests whose cache failed to load: not offered again
        self.frees = HolderQueues("bubbletea-kv-free")
        self._stats = BubbleTeaStats()  # this interval's, for vLLM
        self.totals = BubbleTeaStats()  # since start, for the line logged at shutdown
        self._stats_lock = threading.Lock()  # frees are counted on the freeing threads

    def _count(self, name: str) -> None:
        with self._stats_lock:
            self._stats.count(name)
            self.totals.count(name)

    def _handle(self, request: Request) -> Handle | None:
        try:
            return parse_handle(request.kv_transfer_params)
        except BadCache as exc:
            self._count("fallbacks")
            logger.warning("request %s: %s; vLLM computes the prompt itself", request.request_id, exc)
            request.kv_transfer_params = None  # said once, not at every scheduling attempt
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        h = self._handle(request)
        if h is None or request.request_id in self.failed:
            return 0, False
        n = max(0, h.loadable(len(request.prompt_token_ids or [])) - num_computed_tokens)
        return n, n > 0  # asynchronous: vLLM's API wants False with 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # Called a second time once the load finished, with 0: nothing more to do then.
        if num_external_tokens <= 0:
            return
        h = parse_handle(request.kv_transfer_params)
        if h is None:
            raise ConnectorContractError(
                f"vLLM allocated {num_external_tokens} external tokens for {request.request_id}, "
                "which has no BubbleTea handle: the connector offered it none"
            )
        if request.request_id in self.pending:
            raise ConnectorContractError(f"a second load noted for {request.request_id} before the first was shipped")
        groups = blocks.get_block_ids()
        if len(groups) != 1:
            raise ConnectorContractError(f"{len(groups)} KV cache groups; the connector fills one")
        prompt = list(request.prompt_token_ids or [])
        end = h.loadable(len(prompt))
        block_ids = list(groups[0])
        if end > len(block_ids) * self.block_size:
            raise ConnectorContractError(
                f"{request.request_id}: {len(block_ids)} blocks of {self.block_size} allocated for {end} positions"
            )
        self.pending[request.request_id] = Load(
            req_id=request.request_id,
            handle=h,
            prompt=prompt[:end],
            start=end - num_external_tokens,
            end=end,
            block_ids=block_ids,
        )
        self.requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BubbleTeaMetadata:
        """Every load noted this step, shipped. An asynchronous load's request is not scheduled
        for compute in the step that allocated its blocks (it waits for the load): if vLLM
        scheduled one, it would compute over blocks not yet written."""
        meta = BubbleTeaMetadata(loads=list(self.pending.values()))
        self.pending.clear()
        for load in meta.loads:
            self.shipped[load.req_id] = load.blocks_loaded(self.block_size)
        scheduled = scheduler_output.num_scheduled_tokens
        early = [load.req_id for load in meta.loads if scheduled.get(load.req_id)]
        if early:
            raise ConnectorContractError(
                f"vLLM scheduled {early} for compute in the step their BubbleTea KV cache load starts: "
                "it no longer waits for asynchronous loads as 0.32 did"
            )
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which loads ended, and which of them failed (their blocks among the invalid ones:
        the workers report a failure no later than the load's end)."""
        if output.invalid_block_ids:
            for req_id, blocks in self.shipped.items():
                if blocks & output.invalid_block_ids and not self.requests[req_id].is_finished():
                    self.failed.add(req_id)
        for req_id in output.finished_recving or ():
            if self.shipped.pop(req_id, None) is None:
                raise ConnectorContractError(f"a worker reported a load of {req_id} that was never shipped")
            self.requests.pop(req_id, None)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Free the cache (its blocks in vLLM are vLLM's to free: False)."""
        # A load still pending is shipped all the same: vLLM keeps the blocks of a request that
        # ends while WAITING_FOR_REMOTE_KVS until a worker reports its load finished.
        self.failed.discard(request.request_id)
        try:
            h = parse_handle(request.kv_transfer_params)
        except BadCache:
            h = None
        if h is not None:
            holder, key = h.holder, h.key
            self.frees.submit(holder, lambda: self._free(holder, key))
        return False, None

    def _free(self, holder: str, key: str) -> None:
        if self.client.free(holder, key):
            self._count("frees")
        else:  # expired or freed already (a client that freed it itself): nothing held, nothing lost
            logger.debug("the KV cache of %s was no longer held on %s", key, holder)

    def take_stats(self) -> BubbleTeaStats | None:
        with self._stats_lock:
            return self._stats.take()

    def shutdown(self) -> None:
        if not self.frees.wait_idle(timeout_s=2.0):
            logger.warning("stopping with %d BubbleTea KV cache frees not done", self.frees.pending())
        with self._stats_lock:
            totals = ", ".join(f"{k}={self.totals.data[k]}" for k in SCHEDULER_SIDE)
        logger.info("BubbleTea connector (scheduler) stopping: %s", totals)
        self.client.close()
