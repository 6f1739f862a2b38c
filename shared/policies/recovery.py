"""Recovery of a training run from a lost worker (pure): when to checkpoint, where to resume.

A run that checkpoints (`training.checkpoint_every` > 0) survives the loss of a worker: its peers
notice the lease gone, the run pauses, a replacement process takes the free slot, and the run
resumes (`plan_resume`):

* **from its live peers** where it can: the newest state any worker holds (the iteration it last
  stepped) is where the run goes on, and a worker without it (the replacement, or one whose
  cut-short iteration's step never came) takes it from a live worker of its own stage: a DP peer
  holds the same weights and optimizer state, as torchft's live recovery hands them over. Nothing
  is trained twice, and nobody rewinds to a file.
* **from the newest checkpoint every slot wrote** where some stage has no live worker with that
  state (one replica, DP = 1, or every replica of the stage lost): a slot's own newer checkpoint is
  no use, the others cannot rejoin it.

Training is deterministic given the weights, the optimizer state and the iteration (microbatch j of
replica d in iteration i is the same text everywhere), so the losses after resumption equal those of
a run that never stopped.

No I/O here: the worker reads which iterations each slot has checkpointed and asks these functions.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

#: The iteration a run resumes *after* when no checkpoint is common to every slot: it starts over
#: from the initial weights at iteration 0.
FROM_SCRATCH = -1


def checkpoint_due(iteration: int, every: int) -> bool:
    """Whether a worker checkpoints after finishing `iteration` (0-based): after every `every`-th."""
    return every > 0 and (iteration + 1) % every == 0


def save_due(iteration: int, every: int, limit: int | None) -> bool:
    """Whether a run asked to save (`bubbletea train --save`) writes its state after `iteration`:
    after every `every`-th (`training.save_every`, 0 = never) and after the last of `limit`."""
    return (limit is not None and iteration == limit - 1) or checkpoint_due(iteration, every)


def clean_stop_iteration(newest: int, limit: int) -> int:
    """Where a run told to stop under `--save` stops: two past the newest iteration any worker
    reported (stages are at most one iteration apart, so none has passed it yet), at most the last."""
    return min(newest + 2, limit - 1)


def resume_after(checkpoints: Mapping[str, Collection[int]], slots: Iterable[str]) -> int:
    """The newest iteration every slot in `slots` has a checkpoint of (training resumes at the next
    one), or `FROM_SCRATCH` if they have none in common."""
    common: set[int] | None = None
    for s in slots:
        have = set(checkpoints.get(s, ()))
        common = have if common is None else common & have
    return max(common) if common else FROM_SCRATCH


def superseded(iterations: Iterable[int], keep: int) -> list[int]:
    """A slot's checkpoints to delete once it wrote a new one: all but the newest `keep`."""
    return sorted(iterations, reverse=True)[keep:]


#: In `Resume.copies`: the stage's workers take the state from their own slots' checkpoints.
OWN_CHECKPOINT = -1


class Source(enum.StrEnum):
    """Where a resumed run's state comes from."""

    PEERS = "peers"  # what the live workers hold, handed to those without it
    CHECKPOINT = "checkpoint"  # the newest checkpoint every slot wrote
    SCRATCH = "scratch"  # the initial weights (nothing trained, or nothing saved)


@dataclass(frozen=True)
class Resume:
    """Where a generation resumes: after iteration `after`, from `source`; with PEERS, `copies`
    names each stage whose workers do not all hold that state, and the replica that hands it over
    (`OWN_CHECKPOINT`: none does; each takes its slot's checkpoint of `after`)."""

    after: int
    source: Source
    copies: tuple[tuple[int, int], ...] = ()  # (stage, source replica)

    def encode(self) -> str:
        copies = ",".join(f"{k}:{d}" for k, d in self.copies)
        return f"{self.source}/{self.after}/{copies}"

    @classmethod
    def decode(cls, text: str) -> Resume:
        source, after, copies = text.split("/")
        pairs = tuple((int(k), int(d)) for k, d in (c.split(":") for c in copies.split(",") if c))
        return cls(int(after), Source(source), pairs)

    def source_of(self, stage: int) -> int | None:
        """The replica that hands stage `stage`'s state over (None: every worker of it holds it;
        `OWN_CHECKPOINT`: each worker's own slot's checkpoint)."""
        return next((d for k, d in self.copies if k == stage), None)


def plan_resume(
    stepped: Mapping[tuple[int, int], int],
    checkpoints: Mapping[str, Collection[int]],
    slot_names: Mapping[tuple[int, int], str],
) -> Resume:
    """Where the run resumes, given the iteration each slot (replica, stage) last stepped
    (`FROM_SCRATCH`: none, e.g. a replacement) and which iterations each slot (by name) has a
    checkpoint of: from the live peers if every stage has a worker at the newest iteration any
    worker stepped, else from the newest common checkpoint (the module docstring says why); from
    that checkpoint too where it is newer than any live state (the whole job started again)."""
    newest = max(stepped.values(), default=FROM_SCRATCH)
    saved = resume_after(checkpoints, slot_names.values())
    from_file = Resume(saved, Source.CHECKPOINT) if saved != FROM_SCRATCH else Resume(FROM_SCRATCH, Source.SCRATCH)
    if saved > newest or newest == FROM_SCRATCH:  # e.g. the whole job started again: every worker fresh
        return from_file
    copies: list[tuple[int, int]] = []
    for stage in sorted({k for _, k in stepped}):
        workers = sorted((d, it) for (d, k), it in stepped.items() if k == stage)
        holders = [d for d, it in workers if it == newest]
        if not holders:  # no live worker of this stage holds it: each slot's own checkpoint of it may
            if all(newest in checkpoints.get(slot_names[(d, stage)], ()) for d, _ in workers):
                copies.append((stage, OWN_CHECKPOINT))  # (a drained worker of one replica wrote it)
                continue
            return from_file
        if len(holders) < len(workers):
            copies.append((stage, holders[0]))
    return Resume(newest, Source.PEERS, tuple(copies))


#: This many slots told to leave at once is a stop of the whole run, not a drain.
STOP_QUORUM = 2


def still_leaving(told: Sequence[bytes | None], held: Sequence[bytes | None]) -> int:
    """How many slots are leaving now: told to leave (`told[i]`, the holder that was told) and still
    held by that same holder (`held[i]`, its lease). A leaver that died before it handed its slot
    over, or a slot another worker holds since, is not leaving."""
    return sum(1 for t, h in zip(told, held, strict=True) if t is not None and t == h)


def whole_run_stops(*, marked_stopping: bool, leaving: int, slots: int) -> bool:
    """Whether a worker told to leave stops the whole run rather than drain itself: the run is
    marked stopping (its launcher stops it), or more than one slot is leaving at once (compose down,
    scancel, a deleted StatefulSet signal every worker; a drain is one at a time), or every slot of
    a run of one."""
    return marked_stopping or leaving >= min(STOP_QUORUM, slots)


def needs_state(resume: Resume, replica: int, stage: int, stepped: int) -> bool:
    """Whether worker (replica, stage), having last stepped `stepped`, must load the resumed state
    (from a peer, a checkpoint or the initial weights) rather than keep its own."""
    if resume.source is not Source.PEERS:
        return True
    return stepped != resume.after


def reports_cut_short(in_progress: int | None, stepped: int, resume: Resume) -> bool:
    """Whether a worker joining a recovery reports the iteration it had in progress: it had stepped
    it (the recovery cut its run short between the step and the report) and the run does not rewind
    past it, so the iteration is trained and this worker alone holds its report. One the run rewinds
    past is trained again and reported then; one never stepped is not this worker's to report."""
    return in_progress is not None and in_progress == stepped <= resume.after
