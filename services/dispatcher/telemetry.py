"""What the dispatcher saw, for the run's figures: a `ControlSeen` record per bubble start and
batch report (which bubbles opened with work; the control plane's latency; the layers a report's
requests ran and ran again), kept here and published by the dispatcher's timer in one round trip
to the run's spans stream (shared/figures/runstats.py reads them).

Tested by: tests/integration/test_dispatcher.py (which bubbles opened with work).
"""

from __future__ import annotations

from shared.bus import Bus
from shared.wire import ControlSeen, keys
from shared.wire.status import ControlEvent

#: `ControlSeen` records kept while Redis does not answer (about a minute of a busy run's bubbles).
MAX_TELEMETRY = 10_000


class ControlTelemetry:
    def __init__(self, bus: Bus, run: str) -> None:
        self.bus, self.run = bus, run
        self.kept: list[ControlSeen] = []

    def seen(
        self,
        event: ControlEvent,
        worker: str,
        at: float,
        seen: float,
        *,
        with_work: bool = False,
        run: int = 0,
        recomputed: int = 0,
    ) -> None:
        """Keep this event's record. Past `MAX_TELEMETRY` unpublished records (Redis away), the
        oldest go: telemetry, not work."""
        if len(self.kept) >= MAX_TELEMETRY:
            del self.kept[0]
        self.kept.append(
            ControlSeen(
                run=self.run,
                worker=worker,
                event=event,
                at=at,
                seen=seen,
                with_work=with_work,
                layers_run=run,
                layers_recomputed=recomputed,
            )
        )

    async def flush(self) -> None:
        """Publish the kept records in one round trip (kept if Redis does not answer)."""
        if self.kept:
            batch = list(self.kept)
            await self.bus.publish_many(keys.spans_stream(self.run), batch, maxlen=keys.SPANS_MAXLEN)
            del self.kept[: len(batch)]
