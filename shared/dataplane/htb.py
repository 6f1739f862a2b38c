"""htb's sizes for the kernel WAN (`shared.dataplane.kernel_net`): a class's burst and quantum, its rate as tc
reads it, and how many segments a GSO packet may carry. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math

#: Longest a GSO packet may take on the slowest leaf the DC's traffic meets (see `gso_segments`).
GSO_S = 0.001
#: A full-size Ethernet frame at a 1500-byte MTU: one TCP segment as htb counts it.
FRAME_BYTES = 1514
#: Linux's ceiling on gso_max_segs (no limit beyond gso_max_size, 64 KB).
MAX_GSO_SEGS = 65535

# --- htb burst and quantum -------------------------------------------------------------------
#
# A class's burst is how many bytes it may send back to back, at line rate, after being idle; in
# any interval T it sends at most burst + rate * T. So the burst bounds the shaping error of a
# measurement over T by burst / (rate * T), and it must also cover the time htb sleeps between
# dequeues (its timer can wake late) or a fast class falls short of its rate. tc's own default,
# rate / HZ + MTU, is about one MTU on kernels with 1 ns psched ticks (HZ reads 1e9): at 10 Gbit/s
# that is 1.3 us of sending, and such a class undershoots. Hence:
#
#     burst = min(max(rate * BURST_S, MIN_BURST), rate * MAX_BURST_S, MAX_BURST)      (bytes)
#
# * BURST_S = 1 ms of the rate: covers a late timer at any rate (10 Gbit/s -> 1.25 MB);
# * MIN_BURST = 1600 bytes (tc's MTU default): a full-size frame may leave at once;
# * MAX_BURST_S = 2 s: tc hands the burst to the kernel as a *time* in psched ticks in a u32 (1 ns
#   ticks here, so at most 4.29 s); below ~6 kbit/s, 1600 bytes would take longer than that. A
#   burst shorter than one packet is fine: htb lets a class with tokens >= 0 send a packet and go
#   into debt for it (down to -mbuffer, 60 s), so the average rate stays exact;
# * MAX_BURST = 1 GiB: tc parses a size into 32 bits (only rates above ~8 Tbit/s reach it).
#
# cburst (the burst at the ceil rate) follows the same formula from the ceil. Under this rule a
# 3.28 Mbit/s class bursts 1600 bytes (0.4 % of one second's bytes) and a 10 Gbit/s one 1.25 MB.
BURST_S = 0.001
MIN_BURST = 1600
MAX_BURST_S = 2.0
MAX_BURST = 1 << 30
#: htb's DRR quantum (bytes a class sends per round when several borrow): explicit, so the kernel
#: does not warn that rate / r2q is out of [1000, 200000]. Equal-rate siblings get equal quanta,
#: hence equal shares; small classes get about one frame, so they interleave packet by packet.
MIN_QUANTUM = 1514
MAX_QUANTUM = 200_000


def burst_bytes(rate_bytes_s: int) -> int:
    """htb burst (or cburst) for a class of this rate (bytes/s); see the formula above."""
    b = min(max(rate_bytes_s * BURST_S, MIN_BURST), rate_bytes_s * MAX_BURST_S, MAX_BURST)
    return max(1, math.floor(b))


def quantum_bytes(rate_bytes_s: int) -> int:
    return min(max(burst_bytes(rate_bytes_s), MIN_QUANTUM), MAX_QUANTUM)


def bits(rate_bytes_s: int) -> str:
    """A rate as tc reads it, in bit/s."""
    return f"{rate_bytes_s * 8}bit"


def gso_segments(slowest_ceil_bytes_s: int | None) -> int:
    """gso_max_segs for a namespace whose slowest outgoing leaf has this ceil (None: no WAN link):
    a GSO packet lasts at most `GSO_S` there, so htb's per-packet debt stays that small."""
    if slowest_ceil_bytes_s is None:
        return MAX_GSO_SEGS
    return min(MAX_GSO_SEGS, max(1, math.floor(slowest_ceil_bytes_s * GSO_S / FRAME_BYTES)))
