"""The Atlas slot arbiter for real links: who may transmit on a WAN link now, and why.

On the emulated WAN (`wan.mode: model`) `LinkSharing` computes when each transfer's bytes arrive.
On shaped or real links (`kernel`, `none`) the bytes move on real TCP and the broker only decides
*when each transfer may start*: this policy. Same rules as `LinkSharing`, the same order
(`transfer_priority`), the same link model:

* `fair`: every transfer is granted at once; TCP shares the link between them;
* `temporal` (Atlas): the link goes to one transfer at a time in workload-aware order (earlier
  iteration and microbatch first, then replica); work-conserving like the model: while the
  transfers on the link cannot fill it (window-capped: `flow_cap` < bandwidth) the next in order
  is granted too; a granted transfer is never taken back;
* `fifo`: temporal in arrival order.

A granted transfer whose end is never reported (its receiver died after the sender's bytes left)
would hold its share of the link forever; `expire` reclaims it once it has been granted far longer
than the link model says it can take (`stale_after_s`), with the reason.

Pure: `now` is an input, every call returns the grants it makes, each with the reason.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field

from shared.policies.wan import POLICIES, LinkModel


@dataclass(frozen=True)
class Grant:
    id: str
    why: str


#: A granted transfer is reclaimed after STALE_FLOOR_S + STALE_FACTOR x its time alone on the
#: link: generous (a recovery restarts the run's transfers within seconds), but finite.
STALE_FLOOR_S = 30.0
STALE_FACTOR = 4.0


@dataclass
class _Request:
    id: str
    nbytes: int
    priority: tuple[int, ...]
    submitted: float
    granted: float = 0.0


@dataclass(frozen=True)
class Expiry:
    """What `expire` decided: the transfers reclaimed (id, why) and the grants that freed."""

    reclaimed: list[Grant]
    grants: list[Grant]


@dataclass
class SlotArbiter:
    model: LinkModel
    policy: str = "temporal"
    granted: dict[str, _Request] = field(default_factory=dict)
    _queue: list[tuple[tuple[tuple[int, ...], int], _Request]] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown sharing policy {self.policy!r}; known: {', '.join(POLICIES)}")

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def request(self, transfer_id: str, nbytes: int, priority: tuple[int, ...], now: float) -> list[Grant]:
        """A transfer asks for the link. A request already granted is granted again (the grant
        may have been lost with a broker restart); one already queued stays where it is."""
        if transfer_id in self.granted:
            return [Grant(transfer_id, f"{self.policy}: granted before; granted again (a repeated request)")]
        if any(r.id == transfer_id for _, r in self._queue):
            return []
        self._seq += 1
        req = _Request(transfer_id, nbytes, tuple(priority), now)
        key = (req.priority if self.policy == "temporal" else (), self._seq)
        insort(self._queue, (key, req), key=lambda e: e[0])
        return self._grant(now)

    def done(self, transfer_id: str, now: float) -> list[Grant]:
        """A granted transfer's last byte left: its share of the link is free."""
        if self.granted.pop(transfer_id, None) is None:
            return []
        return self._grant(now)

    def stale_after_s(self, nbytes: int) -> float:
        return STALE_FLOOR_S + STALE_FACTOR * self.model.alone_s(nbytes)

    def expire(self, now: float) -> Expiry:
        """Reclaim the grants whose end never came (see the module docstring)."""
        reclaimed = []
        for req in list(self.granted.values()):
            limit = self.stale_after_s(req.nbytes)
            if now - req.granted > limit:
                del self.granted[req.id]
                why = f"granted {now - req.granted:.1f} s ago and never reported done (limit {limit:.1f} s): reclaimed"
                reclaimed.append(Grant(req.id, why))
        return Expiry(reclaimed, self._grant(now) if reclaimed else [])

    def _grant(self, now: float) -> list[Grant]:
        grants: list[Grant] = []
        if self.policy == "fair":
            while self._queue:
                _, req = self._queue.pop(0)
                req.granted = now
                self.granted[req.id] = req
                grants.append(Grant(req.id, f"fair: granted at once; {len(self.granted)} transfers share the link"))
            return grants
        while self._queue and self._room():
            _, req = self._queue.pop(0)
            busy = len(self.granted)
            req.granted = now
            self.granted[req.id] = req
            order = "workload-aware order" if self.policy == "temporal" else "arrival order"
            if busy == 0:
                why = (
                    f"{self.policy}: link free; first in {order} (priority {list(req.priority)}), "
                    f"{len(self._queue)} waiting"
                )
            else:
                share = busy * self.model.flow_cap / self.model.bandwidth
                why = (
                    f"{self.policy}: the {busy} transfer(s) on the link reach {share:.0%} of it (window-capped); "
                    f"next in {order} shares it, {len(self._queue)} waiting"
                )
            grants.append(Grant(req.id, why))
        return grants

    def _room(self) -> bool:
        """Whether the transfers on the link leave part of it unused (work conservation)."""
        return len(self.granted) * self.model.flow_cap < self.model.bandwidth * (1 - 1e-9)
