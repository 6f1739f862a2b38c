"""What the connector did, in vLLM's own stats and Prometheus metrics.

vLLM collects a connector's `KVConnectorStats` from the workers (`get_kv_connector_stats`, once a
step) and from the scheduler side, adds them up with `aggregate`, logs `reduce()` as "KV Transfer
metrics: ..." at its logging interval, and hands the payload (`data`) to the metrics class that
`build_prom_metrics` made, in the API server's process. So `data` must be plain and serializable:
counts, and the load times as a list (a histogram's observations).

Workers count loads and their failures; the scheduler side counts fallbacks (a handle with no cache
to load) and frees. The Prometheus names are ``vllm:bubbletea_kv_*``.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: The counters, each with what its Prometheus counter says it counts.
COUNTS = {
    "loads": "KV caches BubbleTea prefilled that were loaded into vLLM's blocks",
    "load_failures": "KV caches that could not be loaded (expired, freed, holder gone, wrong prompt or shape)",
    "tokens_loaded": "Prompt positions loaded from BubbleTea's KV caches, which vLLM did not compute",
    "bytes_fetched": "Bytes of KV cache fetched from BubbleTea's holders",
    "fallbacks": "Requests with a BubbleTea handle but no cache to load: vLLM computed the prompt",
    "frees": "KV caches freed on their holder once their request finished",
}
#: The counts the scheduler side keeps (the workers keep the others).
SCHEDULER_SIDE = ("fallbacks", "frees")
#: Seconds to fetch and write one cache, per load that succeeded.
LOAD_SECONDS = "load_seconds"
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class BubbleTeaStats(KVConnectorStats):
    """The connector's counts over one interval (`data`: the counters and the load times)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {**dict.fromkeys(COUNTS, 0), LOAD_SECONDS: []}

    def count(self, name: str, n: int = 1) -> None:
        self.data[name] += n

    def loaded(self, tokens: int, nbytes: int, seconds: float) -> None:
        self.data["loads"] += 1
        self.data["tokens_loaded"] += tokens
        self.data["bytes_fetched"] += nbytes
        self.data[LOAD_SECONDS].append(seconds)

    def take(self) -> BubbleTeaStats | None:
        """This interval's stats (None if nothing happened), and a fresh start for the next."""
        if self.is_empty():
            return None
        taken = copy.copy(self)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in COUNTS:
            self.data[k] += other.data.get(k, 0)
        self.data[LOAD_SECONDS].extend(other.data.get(LOAD_SECONDS, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        times = self.data[LOAD_SECONDS]
        return {
            **{k: self.data[k] for k in COUNTS},
            "load_ms_mean": round(statistics.fmean(times) * 1e3, 2) if times else 0.0,
            "load_ms_max": round(max(times) * 1e3, 2) if times else 0.0,
        }


class BubbleTeaPromMetrics(KVConnectorPromMetrics):
    """``vllm:bubbletea_kv_<count>_total`` counters and the ``vllm:bubbletea_kv_load_seconds`` histogram."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(name=f"vllm:bubbletea_kv_{k}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for k, doc in COUNTS.items()
        }
        self.load_seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:bubbletea_kv_load_seconds",
                documentation="Seconds to fetch a BubbleTea KV cache and write it into vLLM's blocks",
                buckets=list(LOAD_BUCKETS),
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, counter in self.counters.items():
            if n := transfer_stats_data.get(k, 0):
                counter[engine_idx].inc(n)
        for seconds in transfer_stats_data.get(LOAD_SECONDS, ()):
            self.load_seconds[engine_idx].observe(seconds)
