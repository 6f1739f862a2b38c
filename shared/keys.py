"""Every Redis stream name and key prefix BubbleTea uses, in one place.

Each bound or TTL carries a comment saying why it has that value. Services never build key
names by hand; they call the helpers here so a rename is a one-line change.
"""

from __future__ import annotations

PREFIX = "bt"

# --- streams -------------------------------------------------------------------------------

#: Poison messages from every stream: entries that failed to decode, or whose handler failed
#: `bus.max_deliveries` times. Each entry records the source stream, group, id, error and the
#: original payload, so nothing is lost and an operator can replay it.
DEAD_LETTER_STREAM = f"{PREFIX}:dead"

#: The dead-letter stream is trimmed (approximately) at this length. It only grows on bugs or
#: bad input, so 100k entries is days of a broken producer, yet bounded memory (~100 MB worst case).
DEAD_LETTER_MAXLEN = 100_000

#: Streams used by `bench/bus.py` and the `bubbletea demo` bus check.
PING_STREAM = f"{PREFIX}:ping"
PONG_STREAM = f"{PREFIX}:pong"


# --- keys ----------------------------------------------------------------------------------


def health_key(service: str, instance: str) -> str:
    """Key a live service instance refreshes with a TTL (see `shared.health`)."""
    return f"{PREFIX}:health:{service}:{instance}"


HEALTH_KEY_PATTERN = f"{PREFIX}:health:*"

#: A health key lives for this many heartbeat intervals: one missed beat (a GC pause, a slow
#: Redis) must not make a healthy service look dead, three missed beats mean it is gone.
HEALTH_TTL_BEATS = 3


# --- a training run's streams and keys ------------------------------------------------------
# Everything a run creates is prefixed with its run id, so runs (e.g. the benchmark's several
# configurations) never see each other's messages.


def wan_stream(run: str) -> str:
    """Transfer requests from workers to the wan_broker."""
    return f"{PREFIX}:{run}:wan"


def inbox(run: str, replica: int, stage: int) -> str:
    """A stage worker's inbox: activations, gradients and all-reduce shards addressed to it."""
    return f"{PREFIX}:{run}:w:{replica}:{stage}"


def bubbles_stream(run: str) -> str:
    """BubbleStart / BubbleEnd events from every worker (read by the dispatcher)."""
    return f"{PREFIX}:{run}:bubbles"


def fill_stream(run: str, replica: int, stage: int) -> str:
    """Prefill batches from the dispatcher to one worker (kept apart from its training inbox, so
    a flood of prefill work never sits in front of an activation)."""
    return f"{PREFIX}:{run}:fill:{replica}:{stage}"


def prefill_reports_stream(run: str) -> str:
    """Workers' reports on the prefill batches they ran (read by the dispatcher)."""
    return f"{PREFIX}:{run}:prefill:reports"


def prefill_snapshot_key(run: str, request_id: str, layer: int) -> str:
    """A preempted prefill's state (hidden + KV of finished layers) at `layer`, for the worker that
    resumes it. The layer is part of the key: a later snapshot never overwrites the one the
    dispatcher knows about, so a worker that dies mid-batch cannot leave a mismatched state."""
    return f"{PREFIX}:{run}:prefill:snap:{request_id}:{layer}"


#: A snapshot waits for a later bubble; five minutes cover any pipeline's iteration many times
#: over, and a request resumed later than that has long passed its deadline.
PREFILL_SNAPSHOT_TTL_S = 300


def spans_stream(run: str) -> str:
    """Timeline spans of every worker (telemetry: trimmed by length, loss of old spans is fine)."""
    return f"{PREFIX}:{run}:spans"


#: Spans are telemetry: keep the last 500k (a long demo at ~50 spans per worker-iteration).
SPANS_MAXLEN = 500_000


def events_stream(run: str) -> str:
    """Run progress: IterationDone, WorkerFailed, LinkReport."""
    return f"{PREFIX}:{run}:events"


#: Events are small and few; 100k covers thousands of iterations of a large pipeline.
EVENTS_MAXLEN = 100_000


def lease_key(run: str, replica: int, stage: int) -> str:
    """Which worker process holds slot (replica, stage): a TTL lease it renews."""
    return f"{PREFIX}:{run}:lease:{replica}:{stage}"


def lease_end_key(run: str, replica: int, stage: int) -> str:
    """How slot (replica, stage) ended: a hash with its `LeaseState` (``state``) and ``reason``, so
    peers that notice the lease gone tell a finished or stopped worker from a lost one."""
    return f"{PREFIX}:{run}:lease:{replica}:{stage}:end"


#: An end marker outlives any run's tail (peers still finishing their last steps), then goes.
LEASE_END_TTL_S = 3_600

#: A lease lives 3 s and is renewed every second: a crashed worker's slot frees within 3 s, and
#: two missed renewals (a long GC pause, a slow Redis) are survived.
LEASE_TTL_MS = 3_000
LEASE_RENEW_S = 1.0


# --- the serving plane ------------------------------------------------------------------------

#: Accepted prefill requests, from every prefill_queue instance to the dispatcher.
PREFILL_REQUESTS_STREAM = f"{PREFIX}:prefill:requests"


def prefill_results_stream(instance: str) -> str:
    """Where the answers to one prefill_queue instance's requests are delivered."""
    return f"{PREFIX}:prefill:results:{instance}"


def prefill_result_key(request_id: str) -> str:
    """The stored answer to a request, for GET /v1/prefill/{id} from any instance."""
    return f"{PREFIX}:prefill:result:{request_id}"


def prefill_status_key(request_id: str) -> str:
    """A request's status while it has no answer yet (`RequestStatus.QUEUED`)."""
    return f"{PREFIX}:prefill:status:{request_id}"


def kv_cache_key(request_id: str) -> str:
    """A finished prefill's KV cache, for a decode service to fetch (see `shared.kvstore`)."""
    return f"{PREFIX}:prefill:kv:{request_id}"


def idempotency_key(key: str) -> str:
    """Maps a client's Idempotency-Key to the request id it created."""
    return f"{PREFIX}:prefill:idem:{key}"


#: Requests accepted and not yet answered, across all instances (admission control).
PREFILL_INFLIGHT_KEY = f"{PREFIX}:prefill:inflight"

#: Answers, statuses and idempotency keys live a day: long enough for any client to collect them,
#: bounded so an abandoned request's records do not accumulate forever.
PREFILL_RECORD_TTL_S = 86_400


def save_request_key(run: str) -> str:
    """Set (by `bubbletea train --save`) to ask the run's workers for their weights at its end."""
    return f"{PREFIX}:{run}:save"


def weights_key(run: str, stage: int) -> str:
    """One pipeline stage's trained weights (safetensors bytes, the full model's parameter names),
    written by the stage's replica-0 worker at the end of training when the run was asked to save."""
    return f"{PREFIX}:{run}:weights:{stage}"


#: The saved weights wait this long for the launcher that asked for them.
WEIGHTS_TTL_S = 3_600


#: Finished prefills to continue, from the front doors to the decoders (`DecodeRequest`).
DECODE_REQUESTS_STREAM = f"{PREFIX}:decode:requests"


def serving_key(instance: str) -> str:
    """One dispatcher's readiness verdict (`shared.serving.Readiness`, JSON), for the front doors."""
    return f"{PREFIX}:serving:{instance}"


#: The set of dispatcher instances that published a verdict: readers MGET their keys (no SCAN over
#: the keyspace) and drop the members whose key expired.
SERVING_INSTANCES_KEY = f"{PREFIX}:serving-instances"

#: A verdict is rewritten every `READINESS_EVERY_S` (shared.serving); one that is not rewritten for
#: this long belongs to a dispatcher that is gone, and goes.
SERVING_TTL_S = 3
