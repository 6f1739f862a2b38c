"""What the prefill_queue app holds: typed app keys, and the waiters for synchronous requests.

Tested by: tests/integration/test_graceful_stop.py, tests/integration/test_two_runs.py,
tests/integration/test_prefill_api.py."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from services.prefill_queue.metrics import Metrics
from services.prefill_queue.routing import DcRouting
from services.prefill_queue.vllm_decode import VllmDecoder
from shared.bus import Bus
from shared.config.settings import Settings
from shared.control.verdicts import Readiness
from shared.policies.prompt_placement import DecoderLoad, FrontDoorHops
from shared.wire import DecodeChunk, PrefillResult, keys

SERVICE = "prefill_queue"

#: Answers delivered and not yet marked read in Redis, at most (a Redis away for long): past it, an
#: answer's record keeps its hour (`keys.PREFILL_RECORD_TTL_S`) rather than the front door's memory grow.
READ_BACKLOG = 100_000

#: How often a front door marks the answers it delivered as read (`serving.read_by_client`): one round
#: trip for all of them, off the path of the answers themselves.
READ_EVERY_S = 1.0


class Waiters:
    """Futures of the synchronous requests this instance is answering, by request id; and, for
    completions being decoded, a queue of their `DecodeChunk`s."""

    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future[PrefillResult]] = {}
        self._chunks: dict[str, asyncio.Queue[DecodeChunk]] = {}
        # answers handed to their clients, whose records may go soon: (datacenter routed to, id)
        self._read: list[tuple[str | None, str]] = []

    def expect_chunks(self, request_id: str) -> asyncio.Queue[DecodeChunk]:
        q: asyncio.Queue[DecodeChunk] = asyncio.Queue()
        self._chunks[request_id] = q
        return q

    def deliver_chunk(self, chunk: DecodeChunk) -> bool:
        q = self._chunks.get(chunk.id)
        if q is None:
            return False  # its client is gone (or another instance's): dropped, the decoder is not told
        q.put_nowait(chunk)
        return True

    def expect(self, request_id: str) -> asyncio.Future[PrefillResult]:
        fut: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = fut
        return fut

    def deliver(self, result: PrefillResult, dc: str | None = None) -> bool:
        """Hand `result` (of a request routed to `dc`) to the request waiting for it, if any."""
        fut = self._futures.pop(result.id, None)
        if fut is None or fut.done():
            return False
        fut.set_result(result)
        if len(self._read) < READ_BACKLOG:
            self._read.append((dc, result.id))
        return True

    def take_read(self) -> dict[str | None, list[str]]:
        """The ids of the answers delivered since the last call, by the datacenter their requests
        were routed to (`serving.read_by_client` shortens their records' lives)."""
        read, self._read = self._read, []
        by_dc: dict[str | None, list[str]] = {}
        for dc, rid in read:
            by_dc.setdefault(dc, []).append(rid)
        return by_dc

    def forget(self, request_id: str) -> None:
        self._futures.pop(request_id, None)
        self._chunks.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._futures)


class Stopping:
    """Set when the front door begins to stop (SIGTERM): the listening socket is closed already, new
    requests on open connections get 503, and a request still waiting for its answer gets it if it
    lands within `STOP_GRACE_S`, else a 503 saying where its answer will be (it stays queued)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.since = 0.0  # monotonic time it was set

    def set(self) -> None:
        if not self.event.is_set():
            self.since = time.monotonic()
            self.event.set()

    def deadline(self, deadline: float) -> float:
        """A wait's monotonic `deadline`, cut to the grace period once stopping."""
        return min(deadline, self.since + STOP_GRACE_S) if self.event.is_set() else deadline


#: How long requests in flight get to be answered once the front door stops (under the 10 s the
#: server waits for its handlers, and compose's stop_grace_period of 20 s).
STOP_GRACE_S = 5.0


class Gate:
    """The dispatchers' readiness verdict as this instance last read it (`shared.control.serving`).

    `verdict` None: no dispatcher is alive; requests are accepted and wait for one (a dispatcher
    that restarts costs latency, not answers). A verdict that is not ready refuses new requests."""

    def __init__(self) -> None:
        self.verdict: Readiness | None = None
        #: Whether a built-in decoder service is alive to compute prompts (its heartbeat, read every
        #: `DECODERS_EVERY_S`): a prompt is placed on it only then, never on one that is not there.
        self.decoder_live = False

    def refusal(self) -> Readiness | None:
        """The verdict to refuse a new request with, or None to accept it."""
        v = self.verdict
        return v if v is not None and not v.ready else None


#: How often a front door with the built-in decoder re-reads whether one is alive.
DECODERS_EVERY_S = 1.0


SETTINGS = web.AppKey("settings", Settings)
BUS = web.AppKey("bus", Bus)
METRICS = web.AppKey("metrics", Metrics)
STARTED = web.AppKey("started", float)
WAITERS = web.AppKey("waiters", Waiters)
INSTANCE = web.AppKey("instance", str)
GATE = web.AppKey("gate", Gate)
STOPPING = web.AppKey("stopping", Stopping)
#: The front door's own hops, kept out of the time the bubbles are given (`FrontDoorHops`).
HOPS = web.AppKey("front_door_hops", FrontDoorHops)
#: This front door's view of the decoder's own prefill (`services.prefill_queue.on_decoder`).
DECODER_LOAD = web.AppKey("decoder_load", DecoderLoad)
#: Where each request goes with a dispatcher per datacenter (`bubbletea.dispatch: per_dc`), else None.
ROUTING: web.AppKey[DcRouting | None] = web.AppKey("routing")
#: The vLLM server that decodes (decode.engine: vllm), else None: the decoder service does.
VLLM: web.AppKey[VllmDecoder | None] = web.AppKey("vllm")


def instance_results_stream(app: web.Application, dc: str | None = None) -> str:
    """This front door's results stream: the run's (the decoder's chunks; every answer with one
    dispatcher), or, with a dispatcher per datacenter, the one in datacenter `dc`'s tag that the
    answers to the requests it routed there come to."""
    return keys.prefill_results_stream(app[SETTINGS].run, app[INSTANCE], dc)


def served_dcs(app: web.Application) -> list[str | None]:
    """The run's dispatchers, by datacenter (`pipeline_plan.dispatch_dcs`): [None] with one."""
    routing = app[ROUTING]
    return [None] if routing is None else list(routing.dcs)
