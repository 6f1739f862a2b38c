"""Work for KV holders, off vLLM's path: one queue per holder, each drained by a thread of its own.

The connector talks to each holder over one kept connection (`kvclient`), so requests to one holder
take turns anyway. Giving each holder its own queue and thread means a holder that does not answer
(its worker frozen, its host gone) holds up only the loads and frees waiting for it, until the
client's timeout fails them one by one; loads from every other holder go on. A thread lives only
while its holder has work queued, so holders that come and go (workers restarted on new ports)
leave nothing behind. Standard library only.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

# vLLM's logging configuration covers the loggers under "vllm" (VLLM_LOGGING_LEVEL, its format):
# ours is one of them. This module stays free of vLLM, so it asks the standard library by name.
logger = logging.getLogger(f"vllm.{__name__}")


class HolderQueues:
    """Runs jobs in submission order per holder, holders in parallel (thread-safe)."""

    def __init__(self, name: str) -> None:
        self.name = name  # threads are named "<name>-<holder>", as a stack dump shows them
        self._queues: dict[str, deque[Callable[[], None]]] = {}
        self._running = 0  # jobs taken off a queue and not yet done
        self._cond = threading.Condition()

    def submit(self, holder: str, job: Callable[[], None]) -> None:
        """Queue `job` behind the holder's others; it runs on that holder's thread."""
        with self._cond:
            queue = self._queues.get(holder)
            if queue is not None:
                queue.append(job)
                return
            self._queues[holder] = deque([job])
        threading.Thread(target=self._drain, args=(holder,), name=f"{self.name}-{holder}", daemon=True).start()

    def _drain(self, holder: str) -> None:
        while True:
            with self._cond:
                queue = self._queues[holder]
                if not queue:  # checked and removed under the lock, so a later submit starts a thread anew
                    del self._queues[holder]
                    self._cond.notify_all()
                    return
                job = queue.popleft()
                self._running += 1
            try:
                job()
            except Exception:  # a job reports its own outcome; one that raises must not stop the queue
                logger.exception("a %s job for %s raised", self.name, holder)
            finally:
                with self._cond:
                    self._running -= 1

    def pending(self) -> int:
        """Jobs queued or running now."""
        with self._cond:
            return self._running + sum(len(q) for q in self._queues.values())

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job is queued or running; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queues and not self._running, timeout=timeout_s)
