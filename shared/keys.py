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
