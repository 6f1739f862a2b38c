"""Pure, deterministic decision modules (no I/O; time is an input).

The live services, the analytic pipeline model and the simulator feed the same code: placement,
pipeline schedules, WAN link sharing, bubble prediction, prefill cost, request packing, the
dispatch decisions and the fill policy. Each takes `now` as an input and never reads a clock.
"""
