"""What the simulator's serving plane is configured with (`sim.setup.build` reads it from a spec)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.config.spec import BubbleTea
from shared.policies.dc_routing import PUBLISH_EVERY_S
from shared.policies.prefill_cost import PrefillProfile
from shared.policies.prompt_placement import Mode
from sim.dispatchers import DispatchMode


@dataclass(frozen=True)
class ServingConfig:
    workers: tuple[str, ...]  # slot names, "r<replica>s<stage>", indexed like the training slots
    datacenters: tuple[str, ...]  # each worker's DC (a preempted prefill resumes only in its own)
    layers: int  # of the served model
    bubbletea: BubbleTea  # the spec's section: both policies are built from it, as the services build them
    profile: PrefillProfile
    free_memory: int  # bytes a worker reports with each bubble
    kv_bytes: Callable[[int], int]  # a prompt's KV cache size
    timeout_s: float  # a request's deadline after its arrival
    max_queue: int  # the front door's admission limit (beyond it: 429)
    bus_s: float  # one hop over the bus
    #: a request's TTFT objective after its arrival (`prefill.ttft_objective_ms`), if any
    objective_s: float | None = None
    #: where prompts may be computed (`prefill.placement`): the decoder's are counted, not timed
    placement: Mode = Mode.BUBBLES
    #: one dispatcher for the run, or one per datacenter with the front door routing (`sim.dispatchers`)
    dispatch: DispatchMode = DispatchMode.ONE
    #: per DC: how often each dispatcher publishes its snapshot and the front door reads them (the
    #: live readiness interval; shorter to see what the snapshots' staleness costs)
    snapshot_every_s: float = PUBLISH_EVERY_S
