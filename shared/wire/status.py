"""Every status in the system as an enum (like vLLM's `RequestStatus`, arq's `JobStatus`).

The members' values are what goes on the wire (msgspec encodes an enum by value) and into Redis
records, so they are stable names; code compares members, never strings. What a status means for a
client (an HTTP code) is a table in the front door, keyed by these members.
"""

from __future__ import annotations

import enum


class RequestStatus(enum.StrEnum):
    """Where an accepted prefill request is. QUEUED until its one answer is stored."""

    QUEUED = "queued"  # accepted and on the bus, no answer yet (waiting, or running in a bubble)
    DONE = "done"  # answered: first token, logprobs, KV handle
    FAILED = "failed"  # answered with a `FailureReason`
    #: handed back to the front door: the bubbles cannot compute it by its TTFT objective, the
    #: decoder computes it (`prefill.placement: auto`; shared/policies/prompt_placement.py)
    MOVED = "moved"


class FailureReason(enum.StrEnum):
    """Why an accepted request was failed explicitly (it is never dropped silently)."""

    DEADLINE = "deadline"  # its deadline passed before pipeline bubbles could run it
    STATE_EXPIRED = "state_expired"  # the saved partial prefill it should resume from had expired
    MODEL_REFUSED = "model_refused"  # the worker's model cannot run this prompt (e.g. another spec's limits)
    KV_MISSING = "kv_missing"  # the decoder found no KV cache for it (expired, or never stored)
    UNAVAILABLE = "unavailable"  # nothing can serve it: training finished, stopped or stalled (`ServingState`)
    OVERLOADED = "overloaded"  # more prefill is queued ahead of it than the bubbles serve before its deadline
    PREFILL_ERROR = "prefill_error"  # the worker's prefill model raised running it (out of memory, say)
    #: not a failure: the bubbles cannot compute it by its objective; the decoder does (status MOVED)
    TO_DECODER = "to_decoder"
    #: the dispatcher could not handle it (its entry was dead-lettered: the dead-letter stream,
    #: the run's bt:{<run>}:dead, says why); answered so, not left to its client's timeout
    DEAD_LETTERED = "dead_lettered"


class PromptPlacement(enum.StrEnum):
    """Where a prompt was computed (`shared.policies.prompt_placement`; named in its answer)."""

    BUBBLES = "bubbles"  # in the training bubbles (a stage worker's prefill)
    DECODER = "decoder"  # by the decoder itself (vLLM's own prefill)


class ItemOutcome(enum.StrEnum):
    """How far one request of a prefill batch got on a worker (`PrefillProgress`)."""

    PARTIAL = "partial"  # ran some layers (or none) and stopped: resume at `reached_layer`
    DONE = "done"  # finished and answered
    FAILED = "failed"  # answered with a failure; nothing to resume

    @property
    def finished(self) -> bool:
        """The request left the dispatcher's hands: answered, one way or the other."""
        return self is not ItemOutcome.PARTIAL


class LeaseState(enum.StrEnum):
    """How a worker's slot ended, as its peers read it from the slot's end marker."""

    DONE = "done"  # trained to the end: its departure is not a failure
    STOPPED = "stopped"  # stopped on purpose (Ctrl-C, SIGTERM): peers stop quietly too
    ABORTED = "aborted"  # stopped because of another slot's failure, whose reason it carries
    LEFT = "left"  # told to leave (a drain, an eviction): the run goes on with a spare or replacement


class ServingState(enum.StrEnum):
    """Whether prefill can be served now, as the dispatcher judges it (`shared.policies.readiness`)."""

    SERVING = "serving"  # every slot of the run is training and bubbles are announced
    STARTING = "starting"  # training has not started: not every slot is held yet (or set-up runs long)
    JOINING = "joining"  # every slot is held, its workers set up: requests wait for the first bubbles
    STALLED = "stalled"  # every slot is held, but no bubble was announced for `unready_after_s`
    FINISHED = "finished"  # the run trained all its iterations
    STOPPED = "stopped"  # the run was stopped on purpose (Ctrl-C, SIGTERM)
    RECOVERING = "recovering"  # a worker was lost; the run waits for a replacement to resume
    LOST = "lost"  # a worker was lost and the run stopped because of it
    DISABLED = "disabled"  # BubbleTea is off in the spec: bubbles are not filled
    #: every worker stopped taking prefill after its prefill failed batch after batch (training goes on)
    PREFILL_FAILED = "prefill_failed"

    @property
    def ready(self) -> bool:
        """Whether new requests are taken: while a run's workers set up, they wait for its first
        bubbles. Not while it waits for a lost worker's replacement: that may never come (a host
        lost for good, no spare), and a request taken then would only wait for its deadline."""
        return self in (ServingState.SERVING, ServingState.JOINING)


class ControlEvent(enum.StrEnum):
    """Which control message the dispatcher saw (`ControlSeen`, telemetry for the run's figures)."""

    BUBBLE_START = "bubble_start"  # a worker's bubble opened
    REPORT = "report"  # a worker reported a prefill batch


class DispatcherRole(enum.StrEnum):
    """What a dispatcher is to its run (`shared.policies.leadership`; in its heartbeat)."""

    LEADER = "leader"  # holds the run's dispatcher lease: the only one that reads and dispatches
    STANDBY = "standby"  # another holds it: reads nothing, takes the lease when it expires
