"""What one flush of the dispatcher writes, in one round trip: its batches to the workers' fill
streams, its answers, the saved partial prefills it no longer needs, then the acks of what it
handled (held requests answered or failed, the entries of the read); fenced by the run's
dispatcher lease when it leads under one.

Fenced, the round trip is one script that checks the lease's value first, then appends the batches,
deletes the states and acks; with answers to write, one MULTI/EXEC of three such steps, each
checking first: that script without the acks, the answers (`serving.queue_answer` with the fence),
and the acks. MULTI/EXEC runs them with nothing in between, so all see the same value: everything is
written, or (the lease is another's, or nobody's) nothing is, and the entries stay pending for the
dispatcher that leads now, which claims them. A deposed leader
resumed from a stall cannot hand a worker a batch even in the instant after it resumes.

Tested by: tests/integration/test_dispatcher_leadership.py (fenced), tests/integration/test_dispatcher.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from shared.control import serving
from shared.wire import FIELD, PrefillResult

# KEYS: the lease, then n streams to append to, then m keys to delete, then k streams to ack on.
# ARGV: the lease's holder, the field, n, m, k, then the n payloads, then for each of the k
# streams its group, its count of ids and the ids (acked 500 at a time: Lua's unpack is bounded).
_FENCED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local n, m, k = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
for i = 1, n do redis.call('XADD', KEYS[1 + i], '*', ARGV[2], ARGV[5 + i]) end
for i = 1, m do redis.call('DEL', KEYS[1 + n + i]) end
local a = 6 + n
for j = 1, k do
  local group, c = ARGV[a], tonumber(ARGV[a + 1])
  for s = a + 2, a + 1 + c, 500 do
    redis.call('XACK', KEYS[1 + n + m + j], group, unpack(ARGV, s, math.min(s + 499, a + 1 + c)))
  end
  a = a + 2 + c
end
return 1
"""


@dataclass
class Writes:
    """One flush's writes, in the order they go."""

    batches: list[tuple[str, bytes]] = field(default_factory=list)  # (fill stream, encoded PrefillBatch)
    answers: list[tuple[PrefillResult, str]] = field(default_factory=list)  # (answer, reply stream)
    gone: list[str] = field(default_factory=list)  # saved partial prefills no batch resumes from
    acks: list[tuple[str, str, list[str]]] = field(default_factory=list)  # (stream, group, ids), last

    def __bool__(self) -> bool:
        """Whether there is anything to write besides acks (acks alone wait for their consumer's)."""
        return bool(self.batches or self.answers or self.gone)


async def execute(r: Redis, run: str, w: Writes, fence: tuple[str, str] | None = None, dc: str | None = None) -> bool:
    """Write `w`, `run`'s dispatcher's (datacenter `dc`'s), in one round trip; with a `fence` (the
    lease's key and the value it must hold), only while the lease holds it. Returns whether it was
    written (False: refused, nothing was). Everything in `w` is under the dispatcher's tag."""
    acks = [(stream, group, ids) for stream, group, ids in w.acks if ids]
    if fence is not None and not w.answers:  # one script: atomic alone, no MULTI needed
        return bool(await r.eval(*_fenced(fence, w.batches, w.gone, acks)))
    async with r.pipeline(transaction=fence is not None) as pipe:
        if fence is None:
            for address, data in w.batches:
                pipe.xadd(address, {FIELD: data})
            for result, reply_to in w.answers:
                serving.queue_answer(pipe, run, result, reply_to, dc=dc)
            if w.gone:
                pipe.delete(*w.gone)
            for stream, group, ids in acks:  # after the effects: a request is acked once answered
                pipe.xack(stream, group, *ids)
            await pipe.execute()
            return True
        pipe.eval(*_fenced(fence, w.batches, w.gone, []))
        for result, reply_to in w.answers:
            serving.queue_answer(pipe, run, result, reply_to, fence, dc)
        if acks:  # after the answers: a request is acked once answered
            pipe.eval(*_fenced(fence, [], [], acks))
        replies: Any = await pipe.execute()
    return bool(replies[0])


def _fenced(
    fence: tuple[str, str],
    batches: list[tuple[str, bytes]],
    gone: list[str],
    acks: list[tuple[str, str, list[str]]],
) -> tuple[Any, ...]:
    """`_FENCED`'s arguments to EVAL."""
    key, holder = fence
    names = [key, *(a for a, _ in batches), *gone, *(s for s, _, _ in acks)]
    args: list[Any] = [holder, FIELD, len(batches), len(gone), len(acks), *(d for _, d in batches)]
    for _, group, ids in acks:
        args += [group, len(ids), *ids]
    return (_FENCED, len(names), *names, *args)
