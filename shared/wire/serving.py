"""The serving plane's messages: prefill requests and results, batches and reports, snapshots, decoding."""

from __future__ import annotations

import msgspec

from shared.wire.base import Message, TensorBlob
from shared.wire.status import FailureReason, ItemOutcome, PromptPlacement, RequestStatus


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
    #: wall clock: when its prompt is due for its TTFT objective (None: no objective); past it, it
    #: is not left waiting for a bubble (shared/policies/prompt_placement.py)
    objective: float | None = None
    #: the decoder may compute it where the bubbles cannot by `objective` (`prefill.placement: auto`)
    may_move: bool = False
    #: seconds: what the decoder's recent prompts took to a first token as the front door saw them
    #: when this one came (`DecoderLoad`; 0: not measured); the dispatcher keeps at least this
    #: much of the objective for the decoder (`prompt_placement.kept_s`)
    decoder_s: float = 0.0


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
    placement: PromptPlacement = PromptPlacement.BUBBLES  # where its prompt was computed

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.DONE


class DecodeRequest(Message, frozen=True, kw_only=True, tag="decode_request"):
    """A finished prefill to continue: the decoder loads the KV cache of request `id` (whose
    metadata carries the prompt and its first token) and generates up to `max_tokens` tokens in
    all, the first token included, stopping early at a `stop` sequence. With `prompt`, a prompt
    to compute first (the decoder's own prefill: `shared.policies.prompt_placement`): there is no
    cache to load, and the first token is the decoder's, sent in a chunk of `index` 0 at once."""

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
    #: The prompt's tokens, where the decoder computes the prompt itself (empty: continue a prefill).
    prompt: tuple[int, ...] = ()


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
    #: The handle of the state to resume from (`keys.prefill_snapshot_key`: a Redis key naming the
    #: worker that holds the state) when from_layer > 0.
    snapshot_key: str = ""
    #: The dispatcher's predicted time for these blocks (ms, the run's clock): what the item
    #: counts for in the worker's credit, which the worker's bubble events report back.
    predicted_ms: float = 0.0
    #: Wall clock: when its prompt is due (its TTFT objective or its deadline, the sooner; 0: never).
    #: A worker that comes to it later fails it rather than answer late (never queued past it).
    due: float = 0.0
    #: Wall clock: by when the dispatcher has moved its prompt to the decoder if it waited between
    #: bubbles (0: never). A worker whose bubble opened after that leaves it unrun
    #: (`fill.moved_on_worker`); one whose bubble opened before runs it (it was not moved).
    moves_from: float = 0.0


class PrefillBatch(Message, frozen=True, kw_only=True, tag="prefill_batch"):
    """dispatcher -> one worker's fill stream: prefill work for the worker to queue; it runs in
    the worker's bubbles, from the next one to open (or the one open now)."""

    run: str
    worker: str
    batch_id: str
    items: tuple[PrefillItem, ...]


class PrefillProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far one item of a batch got: `reached_layer` blocks done, `seconds` spent on it now.
    `outcome` DONE or FAILED: the worker answered the request; PARTIAL: resume at `reached_layer`."""

    id: str
    outcome: ItemOutcome
    reached_layer: int
    seconds: float
    #: The layer this worker started it from: below the item's `from_layer` when the saved state
    #: it would resume from was in another datacenter or lost (computed again); -1: `from_layer`.
    started_layer: int = -1
    #: Wall clock: when the worker answered it (DONE or FAILED; 0: not said). The report comes when
    #: the batch is done, later than an answer sent as soon as its request was.
    answered_at: float = 0.0


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
