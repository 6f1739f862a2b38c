"""The connector's worker side, in each vLLM model worker: fetch a cache, write it into the blocks.

`start_load_kv` hands each load the scheduler shipped to a thread of its holder's (`holders`) and
returns: the forward pass does not wait. The thread fetches the cache (`kvclient`), checks that it
was computed for this request's tokens and this model's shape, and writes every layer's keys and
values into the request's blocks through the attention backend's own ``do_kv_cache_update``
(`layout`), the call a forward pass makes. vLLM has parked the request meanwhile
(WAITING_FOR_REMOTE_KVS): no forward pass reads those blocks until `get_finished` reports the
load, which it does only once the writes are complete.

A load that fails reports its blocks through `get_block_ids_with_load_errors` and its request as
finished all the same (vLLM's contract for asynchronous loads: the failed blocks no later than the
pass that reports the request finished; both are recorded together here, and vLLM asks for the
finished ids first). vLLM then fails the request or recomputes its prompt, as its
``kv_load_failure_policy`` says.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from bubbletea_vllm.handle import BadCache, check, layer_index, metadata
from bubbletea_vllm.holders import HolderQueues
from bubbletea_vllm.kvclient import KvClient, KvUnavailable
from bubbletea_vllm.layout import CacheFile, slot_mapping
from bubbletea_vllm.metadata import BubbleTeaMetadata, ConnectorContractError, Load
from bubbletea_vllm.stats import SCHEDULER_SIDE, BubbleTeaStats

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer with a paged KV cache, as the forward context holds it."""

    index: int  # the decoder layer: model.layers.<index>.self_attn.attn
    module: Any  # vLLM's Attention layer (num_kv_heads, head_size, impl)
    kv_cache: torch.Tensor


def attention_layers(forward_context: ForwardContext) -> list[AttentionLayer]:
    """The layers a cache is written into: those with a paged KV cache and a backend that writes it."""
    layers = []
    for name, module in forward_context.no_compile_layers.items():
        kv = getattr(module, "kv_cache", None)
        if isinstance(kv, torch.Tensor) and kv.numel() and hasattr(getattr(module, "impl", None), "do_kv_cache_update"):
            layers.append(AttentionLayer(layer_index(name), module, kv))
    return layers


class BubbleTeaWorker:
    """The worker side's state: loads under way, loads done (and the blocks of those that failed)."""

    def __init__(self, block_size: int, client: KvClient) -> None:
        self.block_size = block_size
        self.client = client
        self.loads = HolderQueues("bubbletea-kv-load")
        self._lock = threading.Lock()  # the loading threads report here; vLLM's thread collects
        self.inflight: set[str] = set()
        self._finished: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._stats = BubbleTeaStats()  # this interval's, for vLLM
        self.totals = BubbleTeaStats()  # since start, for the line logged at shutdown
        self._streams: dict[torch.device, Any] = {}

    def start_load_kv(self, meta: BubbleTeaMetadata, forward_context: ForwardContext) -> None:
        if not meta.loads:
            return
        layers = attention_layers(forward_context)
        for load in meta.loads:
            with self._lock:
                if load.req_id in self.inflight:
                    raise ConnectorContractError(f"a second load of {load.req_id} while its first is under way")
                self.inflight.add(load.req_id)
            self.loads.submit(load.handle.holder, functools.partial(self._load, load, layers))

    def _load(self, load: Load, layers: list[AttentionLayer]) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._fetch_and_write(load, layers)
        except (KvUnavailable, BadCache) as exc:
            self._failed(load, str(exc))
            return
        except Exception as exc:  # a bug or a backend's error: the request must still be released
            logger.exception("request %s: loading its BubbleTea KV cache raised", load.req_id)
            self._failed(load, repr(exc))
            return
        seconds = time.perf_counter() - t0
        with self._lock:
            for stats in (self._stats, self.totals):
                stats.loaded(load.end - load.start, nbytes, seconds)
            self._finished.add(load.req_id)
        logger.debug(
            "request %s: loaded positions %d..%d from %s in %.1f ms",
            load.req_id,
            load.start,
            load.end,
            load.handle.holder,
            seconds * 1e3,
        )

    def _failed(self, load: Load, why: str) -> None:
        logger.error("request %s: the BubbleTea KV cache was not loaded: %s", load.req_id, why)
        with self._lock:  # blocks and finished together: never the request without its failure
            self._failed_blocks |= load.blocks_loaded(self.block_size)
            for stats in (self._stats, self.totals):
                stats.count("load_failures")
            self._finished.add(load.req_id)

    def _fetch_and_write(self, load: Load, layers: list[AttentionLayer]) -> int:
        data = self.client.fetch(load.handle.holder, load.handle.key)
        check(metadata(data), load.handle, load.prompt, load.end)
        cache = CacheFile(data)
        if not layers:
            raise BadCache("this model has no attention layer with a paged KV cache to load into")
        for layer in layers:  # every layer's shape before any write
            cache.check_shape(layer.index, layer.module.num_kv_heads, layer.module.head_size)
        device = layers[0].kv_cache.device
        # Deliberate host-to-device copies, on this loading thread: vLLM's GPU-sync check
        # (VLLM_GPU_SYNC_CHECK) polices only the threads running its steps, but says so here too.
        with gpu_sync_allowed(), self._writing_on(device):
            slots = slot_mapping(load.block_ids, self.block_size, load.start, load.end).to(device)
            for layer in layers:
                k, v = cache.rows(layer.index, load.start, load.end, layer.kv_cache.dtype)
                layer.module.impl.do_kv_cache_update(layer.module, k.to(device), v.to(device), layer.kv_cache, slots)
        return len(data)

    @contextlib.contextmanager
    def _writing_on(self, device: torch.device) -> Iterator[None]:
        """Run the writes so that they are complete when the block ends. On a GPU they go on a
        stream of this worker's own, off the forward passes' stream, and are waited for; on a CPU
        they are complete as they return."""
        if device.type != "cuda":
            yield
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    def get_finished(self) -> set[str]:
        """The requests whose loads ended (loaded or failed) since the last call."""
        with self._lock:
            done, self._finished = self._finished, set()
            self.inflight -= done
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._failed_blocks = self._failed_blocks, set()
        return errors

    def take_stats(self) -> BubbleTeaStats | None:
        with self._lock:
            return self._stats.take()

    def shutdown(self) -> None:
        if not self.loads.wait_idle(timeout_s=2.0):
            logger.warning("stopping with %d BubbleTea KV cache loads under way", self.loads.pending())
        with self._lock:
            totals = {k: v for k, v in self.totals.reduce().items() if k not in SCHEDULER_SIDE}
        logger.info("BubbleTea connector (worker) stopping: %s", ", ".join(f"{k}={v}" for k, v in totals.items()))
        self.client.close()
