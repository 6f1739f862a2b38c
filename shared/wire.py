"""The wire format: every message kind as a typed class with one msgpack encoding.

One encoder and one decoder per process, reused (msgspec builds them once). A message on a
stream is a single field, `m`, holding the msgpack bytes of one of the classes below. Each
encoded message carries its kind (the tagged-union tag, field ``kind``) and the wire version
(field ``v``). Decoding anything that is not a known kind at the current version raises
`WireError`; the bus dead-letters such entries instead of half-handling them.

Tensors travel as dtype + shape + raw bytes (`shared.tensors.TensorBlob`), never pickle.

Over 300 lines on purpose: this module is the wire's one index, every message kind in one place.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from shared.status import ControlEvent, FailureReason, ItemOutcome, RequestStatus

#: Bump when a message changes incompatibly; peers at another version are refused loudly.
#: 2: statuses are enums (`shared.status`); unread batch/report timing fields removed.
WIRE_VERSION: Final = 2

#: The stream entry field that holds the encoded message.
FIELD: Final = b"m"


class WireError(ValueError):
    """Bytes that are not a valid message of a known kind at this wire version."""


class TensorBlob(msgspec.Struct, frozen=True, array_like=True):
    """A tensor as it travels: dtype name, shape, and the row-major bytes of its elements.
    Built and read by `shared.tensors` (`to_blob`, `from_blob`)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every message kind. Subclasses set ``tag=`` to their stable kind name."""

    v: int = WIRE_VERSION


class Ping(Message, frozen=True, kw_only=True, tag="ping"):
    """Liveness / latency probe: a consumer answers with a `Pong` carrying the same fields."""

    seq: int
    sent_ns: int
    reply_to: str = ""


class Pong(Message, frozen=True, kw_only=True, tag="pong"):
    seq: int
    sent_ns: int


# --- training plane --------------------------------------------------------------------------


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


class WorkerJoined(Message, frozen=True, kw_only=True, tag="worker_joined"):
    """A worker has set up and entered the run's generation: it trains as soon as every slot has,
    and its first bubble may open at once. Sent ahead of that bubble, so the dispatcher can stage
    its first batch there before it opens (`DispatchState.worker_joined`)."""

    run: str
    worker: str
    replica: int
    stage: int
    typical_bubble_ms: float  # the median of its predicted bubbles: what a staged batch may fill
    free_memory_bytes: int
    at: float  # wall clock (time.time())


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
    latency and which bubbles opened with work from these (bubbletea/runstats.py)."""

    run: str
    worker: str
    event: ControlEvent
    at: float  # sent by the worker (wall clock)
    seen: float  # handled by the dispatcher (wall clock)
    #: bubble starts: requests were queued, or a batch was staged for this worker, as it opened
    with_work: bool = False


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


# --- serving plane ---------------------------------------------------------------------------


class PrefillRequest(Message, frozen=True, kw_only=True, tag="prefill_request"):
    """A validated prompt accepted by prefill_queue, on its way to the dispatcher."""

    id: str
    model: str
    tokens: tuple[int, ...]
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int = 0  # how many top alternatives to return (0 = only the chosen token's)
    user: str = ""
    submitted: float  # wall clock (time.time())
    deadline: float | None = None  # wall clock; past it the request fails explicitly
    reply_to: str  # the accepting prefill_queue instance's results stream


class PrefillResult(Message, frozen=True, kw_only=True, tag="prefill_result"):
    """The final answer to a PrefillRequest: the first token (DONE) or why it failed (FAILED,
    with a `reason` and a sentence for people in `error`)."""

    id: str
    status: RequestStatus
    reason: FailureReason | None = None
    error: str = ""
    token: int = -1
    text: str = ""
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()
    prompt_tokens: int = 0
    kv_key: str = ""  # the KV cache's key for a decode service: a Redis key, or an id on `kv_holder`
    #: Set when the KV cache stays on the data plane (`prefill.kv_store: plane`): the address,
    #: "host:port", of the KV server of the worker that holds it in memory (`shared.dataplane.kv`).
    kv_holder: str = ""
    kv_bytes: int = 0
    kv_expires_at: float = 0.0  # wall clock
    kv_note: str = ""  # why no KV cache was stored (kv_key empty), e.g. the KV byte budget was full
    worker: str = ""
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    finished: float = 0.0  # wall clock

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.DONE


class DecodeRequest(Message, frozen=True, kw_only=True, tag="decode_request"):
    """A finished prefill to continue: the decoder loads the KV cache of request `id` (whose
    metadata carries the prompt and its first token) and generates up to `max_tokens` tokens in
    all, the first token included, stopping early at a `stop` sequence."""

    id: str
    model: str
    max_tokens: int  # in all, the prefill's first token included (OpenAI's max_tokens)
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos: tuple[int, ...] = ()  # tokens that end the completion (the model's EOS; none with ignore_eos)
    submitted: float  # wall clock
    deadline: float | None = None  # wall clock; past it decoding stops with a failure
    reply_to: str  # the accepting front door's results stream
    #: Where the KV cache is: empty = the Redis key of `id` (`prefill.kv_store: redis`); else the
    #: data-plane holder of the prefill's answer (`PrefillResult.kv_holder`).
    kv_holder: str = ""


class DecodeChunk(Message, frozen=True, kw_only=True, tag="decode_chunk"):
    """Tokens the decoder generated for request `id` since its last chunk (`index`: the position
    in the completion of the first of them, the prefill's token being 0). The last chunk has
    `done`, with `finish_reason` ("length" or "stop", and the `stop_reason` sequence) or, for a
    failure, `status` FAILED with a `reason` and a sentence in `error`."""

    id: str
    index: int
    tokens: tuple[int, ...] = ()  # the front door makes the text, from all the completion's tokens
    done: bool = False
    finish_reason: str | None = None
    stop_reason: str | None = None
    status: RequestStatus = RequestStatus.DONE
    reason: FailureReason | None = None
    error: str = ""


class PrefillItem(msgspec.Struct, frozen=True, kw_only=True):
    """One request's share of a batch: run blocks [from_layer, to_layer) of its prompt."""

    id: str
    tokens: tuple[int, ...]
    from_layer: int
    to_layer: int
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int = 0
    submitted: float = 0.0
    reply_to: str = ""
    #: Where the state to resume from is stored (`keys.prefill_snapshot_key`) when from_layer > 0.
    snapshot_key: str = ""


class PrefillBatch(Message, frozen=True, kw_only=True, tag="prefill_batch"):
    """dispatcher -> one worker's fill stream: prefill work for the bubble it just announced."""

    run: str
    worker: str
    batch_id: str
    items: tuple[PrefillItem, ...]
    #: Staged for the worker's next bubble: held there until it starts, not returned at once.
    hold: bool = False


class PrefillProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far one item of a batch got: `reached_layer` blocks done, `seconds` spent on it now.
    `outcome` DONE or FAILED: the worker answered the request; PARTIAL: resume at `reached_layer`."""

    id: str
    outcome: ItemOutcome
    reached_layer: int
    seconds: float


class PrefillReport(Message, frozen=True, kw_only=True, tag="prefill_report"):
    """worker -> dispatcher: a batch ran (fully, partly, or not at all) and where each item is."""

    run: str
    worker: str
    batch_id: str
    progress: tuple[PrefillProgress, ...]
    preempted: bool  # training input arrived (or the bubble ended) before the batch was finished
    at: float = 0.0  # when the worker sent it (wall clock); 0 = unknown (an older worker)


class PrefillSnapshot(Message, frozen=True, kw_only=True, tag="prefill_snapshot"):
    """A preempted prefill's state: the input of block `next_layer` and the KV of blocks before it."""

    id: str
    tokens: tuple[int, ...]
    next_layer: int
    hidden: TensorBlob
    kv: tuple[tuple[TensorBlob, TensorBlob], ...]


#: Every kind the bus can carry. New kinds are added here, so this union is the wire's index.
AnyMessage = (
    Ping
    | Pong
    | TensorReady
    | Transfer
    | SlotRequest
    | SlotGrant
    | SlotDone
    | BubbleStart
    | WorkerJoined
    | BubbleEnd
    | SpanRecord
    | ControlSeen
    | IterationDone
    | WorkerFailed
    | LinkReport
    | PrefillRequest
    | PrefillResult
    | PrefillBatch
    | PrefillReport
    | PrefillSnapshot
    | DecodeRequest
    | DecodeChunk
)

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    """The one msgpack encoding of a message."""
    return _encoder.encode(msg)


def decode(data: bytes | None) -> Message:
    """Decode bytes from the wire; raises `WireError` naming what is wrong."""
    if not data:
        raise WireError("empty message (no payload in field 'm')")
    try:
        msg: Message = _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass: unknown kind, bad field
        raise WireError(f"malformed message: {exc}") from exc
    if msg.v != WIRE_VERSION:
        raise WireError(
            f"unsupported wire version {msg.v} for kind {kind_of(msg)!r}; this peer speaks version {WIRE_VERSION}"
        )
    return msg


def kind_of(msg: Message) -> str:
    """The kind tag of a message, e.g. ``"ping"``; used in logs and metrics."""
    tag: Any = msg.__struct_config__.tag
    return str(tag)
