"""Every Redis stream name and key prefix BubbleTea uses, in one place.

Each bound or TTL carries a comment saying why it has that value. Services never build key
names by hand; they call the helpers here so a rename is a one-line change.
"""

from __future__ import annotations

PREFIX = "bt"

# --- hash tags ------------------------------------------------------------------------------
# Every key and stream of a run is ``bt:{<run>}:<rest>``: the run id in braces is its Redis Cluster
# hash tag, so the run's keys hash to one slot, and every Lua script, MULTI and multi-key command
# (each touches the keys of one tag) runs on one node of a cluster. With a dispatcher per datacenter
# (`bubbletea.dispatch: per_dc`), what each datacenter's dispatcher owns is under a tag of its own,
# ``bt:{<run>:<dc>}:<rest>`` (`dispatch_tag`): its streams, its workers' fill streams, its requests'
# records and count, so one run's datacenters spread over a cluster's masters. The few keys of no
# run (health, ping/pong, the untagged streams' dead letters) are each touched alone.
# (docs/architecture.md, "Keys by hash tag".)

#: What a run id may not contain: the braces delimit the hash tag.
_TAG_BRACES = "{}"


def run_tag(run: str) -> str:
    """The Redis Cluster hash tag of `run`'s keys, ``{<run>}``. A run id with a brace would end the
    tag early (or open another), so it is refused (ValueError)."""
    if not run or any(c in run for c in _TAG_BRACES):
        raise ValueError(f"a run id must be non-empty and hold no '{{' or '}}' (its keys' hash tag): got {run!r}")
    return f"{{{run}}}"


def hash_tag(key: str) -> str | None:
    """The hash tag of `key` as Redis Cluster reads it: the text between the first ``{`` and the
    first ``}`` after it, if that is not empty; None when the whole key is hashed."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


def replication_fence_key(key: str) -> str:
    """A key in `key`'s slot for a one-key write before ``WAIT`` (shared/bus/replicated.py, after a
    redirected pipeline): ``bt:{<tag>}:replicated`` with `key`'s hash tag, or its whole name as the
    tag when it has none (the slot Redis Cluster hashes it to). Bound: a 60 s TTL."""
    tag = hash_tag(key)
    return f"{PREFIX}:{{{key if tag is None else tag}}}:replicated"


def _of(run: str) -> str:
    """The prefix of every key of `run`: ``bt:{<run>}``."""
    return f"{PREFIX}:{run_tag(run)}"


# --- streams -------------------------------------------------------------------------------


def dead_letter_stream(source_stream: str) -> str:
    """Where poison messages from `source_stream` go: entries that failed to decode, or whose
    handler failed `bus.max_deliveries` times. Each entry records the source stream, group, id,
    error and the original payload, so nothing is lost and an operator can replay it. One stream
    per hash tag: ``bt:{<run>}:dead`` for a run's streams, and for a stream with no tag, one under
    the stream's whole name as its tag (``bt:{bt:ping}:dead``: Redis Cluster hashes an untagged key by
    its whole name, so that is the source's own slot). The dead letter and the source's XACK are then
    one MULTI on one slot, on a cluster as on one Redis."""
    tag = hash_tag(source_stream)
    if tag is None and ("{" in source_stream or "}" in source_stream):
        why = "its dead letters could not share its slot"
        raise ValueError(f"stream {source_stream!r} has braces but no hash tag: {why}")
    return f"{PREFIX}:{{{tag or source_stream}}}:dead"


def run_dead_letter_stream(run: str) -> str:
    """The dead letters of every stream of `run` (`dead_letter_stream` of any of its streams)."""
    return f"{_of(run)}:dead"


#: SCAN pattern of every dead-letter stream (each run's ``bt:{<run>}:dead``, and ``bt:{<stream>}:dead``), for
#: an operator looking for them all.
DEAD_LETTER_PATTERN = f"{PREFIX}:*dead"

#: A dead-letter stream is trimmed (approximately) at this length. It only grows on bugs or
#: bad input; 1,000 entries is far more than an operator reads before fixing the cause, and with
#: the payload and error caps below its bytes are bounded: ~1,100 entries (XADD's ``~`` trims whole
#: nodes of 100) x (64 KiB + 1 KiB + ~200 B) = ~72 MB at the very worst.
DEAD_LETTER_MAXLEN = 1_000

#: A dead letter keeps at most this many bytes of the original payload (the first ones); a longer
#: payload is truncated and the entry says so (``payload_truncated``), with the original length
#: (``payload_bytes``) and its SHA-256 (``payload_sha256``). Every message of the demo is far
#: smaller (a 256-token PrefillRequest is ~1 KiB); only a poison blob (e.g. a 1 MB garbage entry)
#: is cut, and 7 of those then cost ~0.5 MB instead of 7 MB.
DEAD_LETTER_PAYLOAD_MAX_BYTES = 64 * 1024

#: The error text of a dead letter is cut at this many characters (a repr of a huge exception
#: must not undo the payload cap).
DEAD_LETTER_ERROR_MAX_CHARS = 1024

#: Streams used by `bench/bus.py` and the `bubbletea demo` bus check (work streams: acked entries
#: are trimmed by their consumers, `bus.max_stream_len`).
PING_STREAM = f"{PREFIX}:ping"

PONG_STREAM = f"{PREFIX}:pong"


# --- keys ----------------------------------------------------------------------------------


def health_key(service: str, instance: str) -> str:
    """Key a live service instance refreshes with a TTL (see `shared.control.health`): bound, the TTL below."""
    return f"{PREFIX}:health:{service}:{instance}"


HEALTH_KEY_PATTERN = f"{PREFIX}:health:*"

#: A health key lives for this many heartbeat intervals: one missed beat (a GC pause, a slow
#: Redis) must not make a healthy service look dead, three missed beats mean it is gone.
HEALTH_TTL_BEATS = 3


# --- a training run's streams and keys ------------------------------------------------------
# Everything a run creates is prefixed with its run id as a hash tag (``bt:{<run>}:``), so runs
# (e.g. the benchmark's several configurations) never see each other's messages, and a run's keys
# share one Redis Cluster slot.
#
# Bounds: the work streams (wan, inboxes, bubbles, fill, reports) are trimmed by their consumers
# once every group acked an entry (`shared.bus.streams.trim_acked`, every 5 s), so they hold only
# unread work; `bus.max_stream_len` warns (never drops) past a backlog. Telemetry (spans, events)
# is trimmed by length at every publish. Keys (snapshots, leases, end markers, weights) have TTLs.
# A finished run's streams stay until deleted (each costs at most its telemetry bounds, a few MB):
# `redis-cli --scan --pattern 'bt:{<run>[:}]*' | xargs redis-cli unlink` removes one (`run_pattern`).


def run_pattern(run: str) -> str:
    """SCAN pattern of every key and stream of `run`, its datacenters' (``bt:{<run>:<dc>}:``) too
    (braces are not special in a MATCH pattern; a run id holds no ':', so no other run's match)."""
    return f"{PREFIX}:{{{run}[:}}]*"


def wan_stream(run: str) -> str:
    """Transfer requests from workers to the wan_broker."""
    return f"{_of(run)}:wan"


def inbox(run: str, replica: int, stage: int) -> str:
    """A stage worker's inbox: activations, gradients and all-reduce shards addressed to it."""
    return f"{_of(run)}:w:{replica}:{stage}"


def dispatch_tag(run: str, dc: str | None) -> str:
    """The hash tag of what one dispatcher owns: the run's, ``{<run>}`` (`dc` None: one dispatcher
    for the run, `bubbletea.dispatch: one`), or one datacenter's, ``{<run>:<dc>}`` (`per_dc`), so a
    run's datacenters spread over a cluster's masters. Everything one script, MULTI or replicated
    pipeline of the serving plane touches is under one of these: the dispatcher's streams and lease,
    its workers' fill streams, its requests' records and in-flight count, the saved partial prefills
    it resumes, and the results streams its answers go to (docs/architecture.md, "Keys by hash
    tag"). A run id holds no ':' (`env_values.run_id`), so ``{a:b}`` is run ``a``'s datacenter ``b``
    and never a run of its own. A datacenter name with a brace is refused (ValueError)."""
    if dc is None:
        return run_tag(run)
    if not dc or any(c in dc for c in _TAG_BRACES):
        raise ValueError(
            f"a datacenter name must be non-empty and hold no '{{' or '}}' (its keys' hash tag): got {dc!r}"
        )
    return run_tag(f"{run}:{dc}")


def under_dispatch_tag(key: str, run: str, dc: str | None) -> bool:
    """Whether `key` is under `dispatch_tag(run, dc)`: in the slot of what that dispatcher owns (a
    reply stream outside it is one its answer script cannot write, and no front door reads for it)."""
    return f"{{{hash_tag(key)}}}" == dispatch_tag(run, dc)


def _dispatch(run: str, dc: str | None) -> str:
    """The prefix of what one dispatcher owns (`dispatch_tag`): ``bt:{<run>}`` or ``bt:{<run>:<dc>}``."""
    return f"{PREFIX}:{dispatch_tag(run, dc)}"


def bubbles_stream(run: str, dc: str | None = None) -> str:
    """BubbleStart / BubbleEnd events from every worker of the run or of datacenter `dc` (read by
    its dispatcher)."""
    return f"{_dispatch(run, dc)}:bubbles"


def fill_stream(run: str, replica: int, stage: int, dc: str | None = None) -> str:
    """Prefill batches from the dispatcher to one worker (kept apart from its training inbox, so
    a flood of prefill work never sits in front of an activation); `dc`: the datacenter whose
    dispatcher serves the worker (None: the run's one), whose tag its batches are written under."""
    return f"{_dispatch(run, dc)}:fill:{replica}:{stage}"


#: The consumer group a worker reads its fill stream in (its slot the consumer). An entry it has not
#: acked is a batch it holds (queued, running, or not read yet): a dispatcher taking over the run
#: counts those as its own (services/dispatcher/takeover.py) rather than send their requests again.
FILL_GROUP = "worker"


def prefill_reports_stream(run: str, dc: str | None = None) -> str:
    """Workers' reports on the prefill batches they ran (read by the run's dispatcher, or by `dc`'s)."""
    return f"{_dispatch(run, dc)}:prefill:reports"


def prefill_snapshot_key(run: str, request_id: str, layer: int, dc: str | None = None) -> str:
    """The handle of a preempted prefill's state (hidden + KV of finished layers) at `layer`: the
    "host:port" of the worker holding it (the state itself stays on that worker's snapshot shelf,
    never in Redis), for the worker that resumes it. The layer is part of the key: a later snapshot
    never overwrites the one the dispatcher knows about, so a worker that dies mid-batch cannot
    leave a mismatched state. Deleting the handle (the dispatcher, once spent) frees the state.
    `dc`: the datacenter of the worker that wrote it (its dispatcher's tag: written with its answers)."""
    return f"{_dispatch(run, dc)}:prefill:snap:{request_id}:{layer}"


#: A snapshot (its handle here, its state on the holder's shelf) waits for a later bubble; five
#: minutes cover any pipeline's iteration many times over, and a request resumed later than that
#: has long passed its deadline.
PREFILL_SNAPSHOT_TTL_S = 300


def spans_stream(run: str) -> str:
    """Timeline spans of every worker (telemetry: trimmed by length, loss of old spans is fine)."""
    return f"{_of(run)}:spans"


#: Spans are telemetry: keep the last 100k (trimmed at every publish, ``MAXLEN ~``). A span is
#: ~150 B on the wire, ~200 B in Redis: ~20 MB at most per run; 100k spans are ~500 iterations of
#: the demo's 4 workers (~50 spans per worker-iteration), more than a report needs.
SPANS_MAXLEN = 100_000


def events_stream(run: str) -> str:
    """Run progress: IterationDone, WorkerFailed, LinkReport."""
    return f"{_of(run)}:events"


#: Events are small (~100 B) and few; 100k (~10 MB at most) covers thousands of iterations of a
#: large pipeline.
EVENTS_MAXLEN = 100_000


def lease_key(run: str, replica: int, stage: int) -> str:
    """Which worker process holds slot (replica, stage): a TTL lease it renews."""
    return f"{_of(run)}:lease:{replica}:{stage}"


def lease_end_key(run: str, replica: int, stage: int) -> str:
    """How slot (replica, stage) ended: a hash with its `LeaseState` (``state``) and ``reason``, so
    peers that notice the lease gone tell a finished or stopped worker from a lost one."""
    return f"{_of(run)}:lease:{replica}:{stage}:end"


#: An end marker outlives any run's tail (peers still finishing their last steps), then goes.
LEASE_END_TTL_S = 3_600


def generation_key(run: str) -> str:
    """The run's recovery generation (an integer): every worker that joins the run, at start or
    after noticing a lost peer, moves it on; workers train together only within one generation."""
    return f"{_of(run)}:gen"


def generation_moves_stream(run: str) -> str:
    """Each move of the run's generation, announced as it happens (a field `gen`), so that workers
    training in the old one wake at once rather than at their next look at `generation_key`, which
    stays the authority: a reader only wakes on an entry, and never decodes it."""
    return f"{_of(run)}:gen:moves"


def generation_joined_key(run: str, generation: int) -> str:
    """The slots that joined `generation` (a set): when it holds every slot, the generation trains."""
    return f"{_of(run)}:gen:{generation}:joined"


def generation_resume_key(run: str, generation: int) -> str:
    """Where `generation` resumes (`shared.policies.recovery.Resume`, encoded: from the live peers'
    state or a checkpoint, after which iteration), written once (SET NX) by the first worker through
    the barrier, so every worker reads the same."""
    return f"{_of(run)}:gen:{generation}:resume"


def generation_stepped_key(run: str, generation: int) -> str:
    """The iteration each slot last stepped as it joined `generation` (a hash: slot -> iteration,
    -1 for none): the state the live workers hold, which the resume point is planned from."""
    return f"{_of(run)}:gen:{generation}:stepped"


def plane_prefix(run: str, generation: int) -> str:
    """The prefix of the data plane's rendezvous keys of `generation` (`shared.dataplane.store`:
    a few keys per group, each with a TTL)."""
    return f"{_of(run)}:plane:{generation}:"


def checkpoint_key(run: str, replica: int, stage: int) -> str:
    """Slot (replica, stage)'s checkpoints: a hash from iteration to the path of its checkpoint file
    (the stage's weights and AdamW moments, safetensors, under BUBBLETEA_STATE_DIR: the bytes never
    ride Redis). Bound: the newest `CHECKPOINTS_KEPT` per slot, and `RUN_STATE_TTL_S` after the
    last write."""
    return f"{_of(run)}:ckpt:{replica}:{stage}"


#: Slots are at most one checkpoint apart (a stage cannot finish an iteration before every other
#: stage has started it), so the newest checkpoint common to all slots is among each slot's newest
#: two. One copy of the model and twice its size in optimizer state, twice over.
CHECKPOINTS_KEPT = 2

#: A run's generation keys and checkpoints go an hour after their last write: a run stopped for
#: longer is not resumed (`bubbletea up` starts a new run id anyway; compose resumes within it).
RUN_STATE_TTL_S = 3_600

#: A lease lives 3 s and is renewed every second: a crashed worker's slot frees within 3 s, and
#: two missed renewals (a long GC pause, a slow Redis) are survived.
LEASE_TTL_MS = 3_000
LEASE_RENEW_S = 1.0


def dispatcher_lease_key(run: str, dc: str | None = None) -> str:
    """Which dispatcher leads the run, or datacenter `dc` of it (its instance name): a TTL lease it
    renews, compare-and-renew. Only the holder dispatches (its writes to the workers are fenced by
    this key's value); every other dispatcher of the run (of `dc`) waits as a standby
    (`shared.policies.leadership`)."""
    return f"{_dispatch(run, dc)}:dispatcher"


def dispatcher_measured_key(run: str, dc: str | None = None) -> str:
    """What the run's (or `dc`'s) leading dispatcher measured of the bubbles (its rate and the
    correction of its predictions: `shared.policies.dc_routing.DcSnapshot`, JSON), rewritten as it
    leads: a dispatcher that takes the lease over from another process starts from it."""
    return f"{_dispatch(run, dc)}:dispatcher:measured"


def dc_snapshot_key(run: str, dc: str) -> str:
    """Datacenter `dc`'s dispatcher's `DcSnapshot` for the front doors (JSON; `bubbletea.dispatch:
    per_dc`): its readiness verdict and what its admission predicts, rewritten with its readiness
    (`dc_routing.publish_every_s`: every tick) and gone `DC_SNAPSHOT_TTL_S` after the last; a front door routes
    each request on them (`dc_routing.Router`)."""
    return f"{_dispatch(run, dc)}:snapshot"


#: A datacenter's snapshot goes this long after its last rewrite: its dispatcher stopped (a front
#: door does not route on one older than `dc_routing.STALE_AFTER_S` in any case).
DC_SNAPSHOT_TTL_S = 10


#: A measurement not rewritten for this long is not taken over: its dispatcher has been gone for
#: many iterations of any pipeline, and what it measured may no longer be the pipeline's.
DISPATCHER_MEASURED_TTL_S = 30


#: The dispatcher's lease lives and is renewed as a worker's does: a dead or stalled leader is
#: replaced within 3 s, and two missed renewals (a long GC pause, a slow Redis) are survived. A
#: stopping leader deletes it, so its successor takes over at once.
DISPATCHER_LEASE_TTL_MS = LEASE_TTL_MS
DISPATCHER_LEASE_RENEW_S = LEASE_RENEW_S


# --- the serving plane ------------------------------------------------------------------------
# A run's request streams and in-flight count carry its run id, like the rest of the run: two runs
# on one Redis never share a consumer group or an admission limit; so are a client's idempotency
# keys (its own choice). A request's own record (status, answer), its KV cache in Redis and a front
# door's results stream are the run's too (under its hash tag), though their ids are unique across
# runs: every script that writes them writes the run's in-flight count and streams as well.


def prefill_requests_stream(run: str, dc: str | None = None) -> str:
    """The run's accepted prefill requests, from every front door of the run to its dispatcher (its
    group's consumers are the run's dispatchers alone: another run on the same Redis has its own);
    with a dispatcher per datacenter, those routed to `dc`, to its dispatcher."""
    return f"{_dispatch(run, dc)}:prefill:requests"


def prefill_results_stream(run: str, instance: str, dc: str | None = None) -> str:
    """Where the answers to one prefill_queue instance's requests of `run` are delivered (and the
    decoder's chunks); with a dispatcher per datacenter, the answers to those it routed to `dc` go
    to one of these per datacenter, in `dc`'s tag, where the answer script writes them."""
    return f"{_dispatch(run, dc)}:prefill:results:{instance}"


#: A front door's results stream: its consumer trims acked answers every 5 s; every answer also
#: caps it at this length (``MAXLEN ~``: a front door reads answers within milliseconds, so 100k
#: is minutes of a stalled reader; ~50 MB at most).
PREFILL_RESULTS_MAXLEN = 100_000

#: Every answer (re)sets this TTL on the results stream it goes to: the stream of a front door that
#: died (its instance id is never reused) goes an hour after its last answer. A live front door
#: idle that long loses its stream and group; its consumer recreates them (NOGROUP is handled).
PREFILL_RESULTS_TTL_S = 3_600


def prefill_request_key(run: str, request_id: str, dc: str | None = None) -> str:
    """A request's record, one hash for GET /v1/prefill/{id} from any instance: field
    `PREFILL_STATUS_FIELD` while it waits (`RequestStatus.QUEUED`), `PREFILL_RESULT_FIELD` (the
    encoded `PrefillResult`) once answered. Bound: `PREFILL_RECORD_TTL_S`. `dc`: the datacenter it
    was routed to (its dispatcher's tag), where it is accepted and answered."""
    return f"{_dispatch(run, dc)}:prefill:req:{request_id}"


#: The fields of `prefill_request_key`: the status while queued, the answer once there is one (the
#: first answer sets it, HSETNX: a later one changes nothing).
PREFILL_STATUS_FIELD = "status"
PREFILL_RESULT_FIELD = "result"


def kv_cache_key(run: str, request_id: str) -> str:
    """A finished prefill's KV cache, for a decode service to fetch (see `shared.dataplane.kvstore`). Bound:
    its TTL, `prefill.kv_ttl_s`, and the byte budget `prefill.kv_budget_mb` (below)."""
    return f"{_of(run)}:prefill:kv:{request_id}"


def kv_budget_bucket_key(run: str, bucket: int) -> str:
    """Bytes of `run`'s KV caches stored during one time bucket (`shared.dataplane.kvstore.KV_BUDGET_BUCKETS`
    buckets span `prefill.kv_ttl_s`): the sum over the live buckets is what the caches can still hold,
    counted against `prefill.kv_budget_mb` (a budget per run). Each counter expires once every cache it
    counted has expired."""
    return f"{_of(run)}:prefill:kvbytes:{bucket}"


def idempotency_key(run: str, key: str) -> str:
    """Maps a client's Idempotency-Key to the request id it created in the run (with a dispatcher
    per datacenter, ``<dc> <id>``: claimed in the run's tag before the request is accepted in its
    datacenter's, `serving.accept`). Per run: the key is the client's choice, not unique across runs,
    and the same key sent to another run on the same Redis is another request (not the first run's,
    which that run's dispatcher never sees)."""
    return f"{_of(run)}:prefill:idem:{key}"


def prefill_inflight_key(run: str, dc: str | None = None) -> str:
    """The requests accepted and not yet answered of the run's dispatcher (or of datacenter `dc`'s),
    across its front doors (admission control: another run's do not count against its
    `prefill.max_queue_depth`, nor another datacenter's against `dc`'s). One integer, no TTL: it is
    the count itself, bounded by `prefill.max_queue_depth`."""
    return f"{_dispatch(run, dc)}:prefill:inflight"


#: Requests' records (status, answer) and idempotency keys live an hour: long enough for any client to collect them
#: (a synchronous request waits `prefill.request_timeout_s`, at most a day, but polls come within
#: seconds), bounded so an abandoned request's records do not accumulate: an answer is ~0.5 KiB, so
#: at 20 req/s an hour of records is ~72k x ~0.7 KiB (with the status and idempotency keys) = ~50 MB
#: (a day would be ~1.2 GB, more than the default maxmemory).
PREFILL_RECORD_TTL_S = 3_600

#: Once its client has read an answer (a front door delivered it to the waiting HTTP request, or a
#: GET returned it), the record goes this much later (never later than its hour): a client's retry of
#: a lost response comes within seconds, and an answer read is not worth an hour of memory. Redis then
#: holds records for about (rate x this) rather than (rate x an hour): at 1,000 requests/s, ~0.6 KiB
#: each, ~70 MB instead of ~2 GB. An answer nobody reads (an abandoned 202) keeps its hour.
PREFILL_READ_GRACE_S = 120


def run_stop_key(run: str) -> str:
    """Set (by `bubbletea up` before it stops its services) when the whole run is being stopped: a
    worker's SIGTERM then stops the run, as it did before drains, rather than ask it to leave."""
    return f"{_of(run)}:stopping"


def drain_key(run: str, slot: str) -> str:
    """Set (by `bubbletea drain SLOT`) to ask the worker of `slot` to leave the run at its next step
    boundary, its slot handed to a spare or a replacement. Bound: `LEASE_END_TTL_S`."""
    return f"{_of(run)}:drain:{slot}"


def leaving_key(run: str, slot: str) -> str:
    """Set to the holder of `slot` when that worker is told to leave (a SIGTERM); deleted as it hands
    the slot over. It counts only while that holder still holds the slot's lease
    (`shared.policies.recovery.still_leaving`): a worker that died between its SIGTERM and its hand
    over leaves a key that no longer counts once its lease expires, so the next single drain is
    not taken for a stop of the whole run. When more than one counts at once (compose down,
    scancel, a deleted StatefulSet: SIGTERM to every worker), the run stops instead. Bound:
    `LEASE_END_TTL_S` (only to clean up)."""
    return f"{_of(run)}:leaving:{slot}"


def save_request_key(run: str) -> str:
    """Set (by `bubbletea train --save`) to ask the run's workers for their state after the
    iterations it saves (`training.save_every`, and the last). Bound: `WEIGHTS_TTL_S`."""
    return f"{_of(run)}:save"


def weights_key(run: str, iteration: int, stage: int) -> str:
    """The path of one pipeline stage's weights after `iteration` (a safetensors file under
    BUBBLETEA_STATE_DIR, named as the saved checkpoint stores them; the bytes never ride Redis),
    written by the stage's replica-0 worker when the run was asked to save."""
    return f"{_of(run)}:weights:{iteration}:{stage}"


def saved_state_patterns(run: str) -> tuple[str, str]:
    """SCAN patterns of every `weights_key` and `train_state_key` of a run."""
    return f"{_of(run)}:weights:*", f"{_of(run)}:trainstate:*"


def stop_after_key(run: str) -> str:
    """Set by `bubbletea train --save` when told to stop: every worker finishes this iteration,
    hands its state over for the save and stops (a clean stop at one iteration for all).
    Bound: `WEIGHTS_TTL_S`."""
    return f"{_of(run)}:stop-after"


def train_state_key(run: str, iteration: int, stage: int) -> str:
    """Beside `weights_key`: the path of the stage's resumable state after `iteration` (its
    parameters and AdamW's, the trainer's checkpoint, a file), which `bubbletea train --resume`
    restores."""
    return f"{_of(run)}:trainstate:{iteration}:{stage}"


#: The saved weights' paths wait this long for the launcher that asked for them (it deletes them
#: and their files once read); only when a run was asked to save.
WEIGHTS_TTL_S = 3_600


def decode_requests_stream(run: str) -> str:
    """Prompts to continue, from the run's front doors to its decoders (`DecodeRequest`). Like the
    request stream, a work stream: trimmed by its consumers once acked (`bus.max_stream_len`)."""
    return f"{_of(run)}:decode:requests"


def serving_key(run: str, instance: str) -> str:
    """One of the run's dispatchers' readiness verdict (`shared.control.serving.Readiness`, JSON),
    for the run's front doors (another run's dispatcher never gates them)."""
    return f"{_of(run)}:serving:{instance}"


def serving_instances_key(run: str) -> str:
    """The set of the run's dispatcher instances that published a verdict: readers MGET their keys
    (no SCAN over the keyspace) and drop the members whose key expired. Bounded by the run's live
    dispatchers (a few) plus the dead ones not yet noticed by a reader; every verdict also resets
    its TTL below, so with no dispatcher left the set goes too."""
    return f"{_of(run)}:serving-instances"


SERVING_INSTANCES_TTL_S = 60

#: A verdict is rewritten every `READINESS_EVERY_S` (shared.control.verdicts); one that is not rewritten for
#: this long belongs to a dispatcher that is gone, and goes.
SERVING_TTL_S = 3
