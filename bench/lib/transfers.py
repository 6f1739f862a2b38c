"""What the transport benches (bench/transport*.py) count transfers in."""

MIB = 1 << 20
#: Warm-up transfers or fetches before the timed ones (checked, not timed).
WARMUP = 2
