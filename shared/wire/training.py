"""The training plane's messages: tensors ready, WAN transfers and slots, bubbles, spans, the run's events."""

from __future__ import annotations

from shared.wire.base import Message
from shared.wire.status import ControlEvent


class TensorReady(Message, frozen=True, kw_only=True, tag="tensor_ready"):
    """An activation (``what="act"``, stage k -> k+1) or its gradient (``"grad"``, k+1 -> k) is on
    the data plane: the receiver posts its receive for it (dtype, shape, tag say what to expect).
    The tensor itself never rides Redis (`shared.dataplane`)."""

    run: str
    what: str  # "act" | "grad"
    iteration: int
    microbatch: int
    replica: int
    src_stage: int
    dst_stage: int
    dtype: str
    shape: tuple[int, ...]
    #: The run's recovery generation it was sent in: a receiver drops tensors of another one (sent
    #: before the run last resumed from a checkpoint), and the groups it travels on are that
    #: generation's.
    generation: int = 0
    #: WAN mode `model`: the bytes move at once, but the receiver may use them only once the
    #: broker's link model says they arrived (the broker then delivers a copy with `release`).
    hold: bool = False
    #: This copy comes from the broker at the modelled arrival time: the held tensor may be used.
    release: bool = False
    #: WAN modes `kernel`/`none`: the transfer id of the WAN slot the sender holds for it; the
    #: receiver frees the slot (`SlotDone`) once the last byte has landed.
    slot: str = ""


class Transfer(Message, frozen=True, kw_only=True, tag="transfer"):
    """Worker -> wan_broker, WAN mode `model`: the bytes of a cross-DC send move on the data plane
    at once; the broker runs them through the src_dc -> dst_dc link model and appends `payload` (a
    small encoded `TensorReady` with `release`) to `deliver_to` when the model says the last byte
    has arrived. `nbytes` is the tensor's size on the data plane."""

    run: str
    transfer_id: str
    src_dc: str
    dst_dc: str
    nbytes: int
    priority: tuple[int, ...]
    deliver_to: str
    payload: bytes
    #: Sender's wall clock (time.time()) when the bytes were ready: the emulated wire starts then,
    #: not when the request reached the broker (one bus hop later).
    sent_at: float = 0.0


class SlotRequest(Message, frozen=True, kw_only=True, tag="slot_request"):
    """Worker -> wan_broker, WAN modes `kernel` and `none`: may this cross-DC transfer go on the
    src_dc -> dst_dc link now? The broker's sharing policy answers with a `SlotGrant` on
    `reply_to` when it may; the worker moves the bytes itself and then sends `SlotDone`."""

    run: str
    transfer_id: str
    src_dc: str
    dst_dc: str
    nbytes: int
    priority: tuple[int, ...]
    microbatch: int
    what: str  # "act" | "grad": the direction along the pipeline
    reply_to: str
    sent_at: float = 0.0


class SlotGrant(Message, frozen=True, kw_only=True, tag="slot_grant"):
    """wan_broker -> worker: transmit `transfer_id` now, and why it was granted now."""

    run: str
    transfer_id: str
    why: str


class SlotDone(Message, frozen=True, kw_only=True, tag="slot_done"):
    """Receiving worker -> wan_broker: the granted transfer's last byte has arrived (the slot is
    free). Sent by the receiver, not the sender: a send returns once its bytes are in the socket
    buffer, which on a slow link holds seconds of data."""

    run: str
    transfer_id: str
    src_dc: str
    dst_dc: str
    #: The transfer's time on the wire, on the receiver's clock: from posting its receive (gloo
    #: moves an announced tensor's bytes once the receiver is ready for them) to the last byte.
    #: 0 when unknown (the sender freeing the slot of a send that failed).
    seconds: float = 0.0


class BubbleStart(Message, frozen=True, kw_only=True, tag="bubble_start"):
    run: str
    worker: str  # "r<replica>s<stage>"
    replica: int
    stage: int
    dc: str
    iteration: int
    position: int  # index of the blocking receive in the stage's action list
    predicted_ms: float
    free_memory_bytes: int
    at: float  # wall clock (time.time())
    #: The prefill work queued on the worker as the bubble opened (predicted ms), by its own count.
    queued_ms: float = 0.0


class WorkerJoined(Message, frozen=True, kw_only=True, tag="worker_joined"):
    """A worker has set up and entered the run's generation: it trains as soon as every slot has,
    and its first bubble may open at once. Sent ahead of that bubble, so the dispatcher can stage
    its first batch there before it opens (`DispatchState.worker_joined`)."""

    run: str
    worker: str
    replica: int
    stage: int
    typical_bubble_ms: float  # the median of its predicted bubbles: what sizes its first credit
    free_memory_bytes: int
    at: float  # wall clock (time.time())
    dc: str = ""


class BubbleEnd(Message, frozen=True, kw_only=True, tag="bubble_end"):
    run: str
    worker: str
    replica: int
    stage: int
    iteration: int
    position: int
    predicted_ms: float
    actual_ms: float
    at: float
    #: The prefill batches that finished in this bubble: their credit is the worker's again now.
    finished: tuple[str, ...] = ()
    #: The prefill work still queued on the worker (predicted ms), by its own count.
    queued_ms: float = 0.0
    #: The bubble's rest the fit rule left empty (ms): from when its next block would not fit what
    #: was left of the bubble (`shared.policies.fill.may_start`) to the input's arrival; admission
    #: counts the bubble less this.
    refused_ms: float = 0.0


class PrefillOff(Message, frozen=True, kw_only=True, tag="prefill_off"):
    """A worker stopped taking prefill: its prefill model failed batch after batch
    (`shared.policies.guest`). It trains on and announces no more bubbles; the dispatcher sends it
    nothing more (the batches it held come back with their reports), and `/ready` names it. A new
    process in its slot joins afresh (`WorkerJoined`)."""

    run: str
    worker: str
    reason: str
    at: float  # wall clock (time.time())


class SpanRecord(Message, frozen=True, kw_only=True, tag="span"):
    """One span of a worker's timeline (wall-clock seconds)."""

    run: str
    replica: int
    stage: int
    iteration: int
    span: str  # fwd, bwd, wait, allreduce, step, prefill
    start: float
    end: float
    microbatch: int = -1
    #: wait spans only: the bubble's predicted length (ms) when it was announced, and when the
    #: awaited training input arrived (wall clock; `end` minus it is how late training resumed)
    predicted_ms: float = -1.0
    input_at: float = 0.0


class ControlSeen(Message, frozen=True, kw_only=True, tag="control_seen"):
    """dispatcher -> the run's spans stream (telemetry): when it handled a worker's bubble start or
    batch report, against when the worker sent it; the run's figures take the control plane's
    latency and which bubbles opened with work from these (shared/figures/runstats.py)."""

    run: str
    worker: str
    event: ControlEvent
    at: float  # sent by the worker (wall clock)
    seen: float  # handled by the dispatcher (wall clock)
    #: bubble starts: work was held on this worker, or requests waited at the dispatcher, as it opened
    with_work: bool = False
    #: batch reports: the prompt layers its requests ran, and of those the ones run again because
    #: the partial state they would have resumed from was in another datacenter (or lost)
    layers_run: int = 0
    layers_recomputed: int = 0


class IterationDone(Message, frozen=True, kw_only=True, tag="iteration_done"):
    """A worker finished an iteration; the last stage reports its replica's mean microbatch loss."""

    run: str
    replica: int
    stage: int
    iteration: int
    started: float
    ended: float
    loss: float | None = None
    lag_ms: float = 0.0  # how far real compute fell behind the device profile
    prefill_lag_ms: float = 0.0  # how far real prefill compute fell behind the prefill profile
    #: The run's recovery generation: after a lost worker the run resumes from a checkpoint and
    #: trains some iterations again; the newest generation's report of an iteration is the one.
    generation: int = 0


class WorkerFailed(Message, frozen=True, kw_only=True, tag="worker_failed"):
    run: str
    slot: str
    reason: str


class LinkReport(Message, frozen=True, kw_only=True, tag="link_report"):
    """wan_broker's per-link utilisation and delivery accuracy, published periodically."""

    run: str
    src_dc: str
    dst_dc: str
    utilization: float  # busy fraction since the broker started
    bytes_sent: float
    transfers: int
    in_flight: int
    late_p99_ms: float  # delivery time minus the policy's arrival time, 99th percentile
    #: Seconds with at least one transfer on the link (granting modes: measured by the receivers;
    #: model mode: the model's busy time). bytes_sent / busy_s is the link's achieved throughput.
    busy_s: float = 0.0
