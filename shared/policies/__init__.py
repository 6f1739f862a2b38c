"""Pure, deterministic decision modules (no I/O; time is an input).

The live services and the analytic pipeline model feed the same code: placement, pipeline
schedules, WAN link sharing, and (later) bubble prediction and request packing.
"""
