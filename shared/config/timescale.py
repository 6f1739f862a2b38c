"""The device time scale: an emulated device this machine can keep.

A device profile makes each operation *count* for a stated time: the worker runs the real
computation, then pads to the profiled duration (`services/stage_worker/train/runner.py`, `fill/compute.py`).
That is honest only while the real work fits inside the time it pads to. When four workers, the
front door, the dispatcher, the load generator and Redis share two cores, it may not: real compute
runs past the profile (lag), and the late work then delays training in a way the emulated device
never would.

So before a run the launcher measures what the real compute of the profiled operations costs here,
with as many processes computing at once as there will be workers (`shared.model.calibration`), and picks the scale
`k` (one profiled millisecond = k real milliseconds) that keeps every operation's real cost within
`SHARE` of its scaled profiled time (`choose_scale`, pure). A profile that would need more than
`WARN_SCALE` still runs at the scale it needs: the launcher warns once, naming the cost, unless the
user set a cap (`--max-time-scale`), past which it is refused. The scale is applied to the spec
(`scale_spec`, pure) by the clock each field declares (docs/config.md, "Clocks"): every device time
(the profile, the WAN's latencies, and the margins and windows sized against bubbles: guard,
dispatch overhead, staging, hold, deadlines) is multiplied by k, device rates (bandwidths) divided
by k, host times kept. The dispatch policy stretches its own windows the same way
(`DispatchState.time_scale`). So every bubble, margin and window keeps its proportions, and only the
host's own latencies (the bus, the event loops) shrink relative to a bubble: the figures report those
as a share of the bubble at k = 1 (`control_share_*`).

The services read the scale from ``BUBBLETEA_TIME_SCALE`` (`shared.config.settings`); ratios (fill ratio,
slowdown, lag share, utilization) are the same on either clock, and times reported as emulated
milliseconds are divided by k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import msgspec.inspect as mi

from shared.config.spec import ClusterSpec, ConfigError

S = TypeVar("S", bound=msgspec.Struct)

#: Real compute may take at most this share of an operation's (scaled) profiled time, its cost
#: measured with every worker computing at once (`measure`: about twice the unshared cost when four
#: workers share two cores). Measured with `bench/bubble_fill.py --quick` on 2 cores (four workers,
#: the front door, the dispatcher, the load generator and Redis), by the scale it led to: at 2.6 the
#: prefill ran 1.9% behind its profile and training 1.0% slower (fill ratio 0.87); at 4, 1.5% and
#: 0.8%; at 5.2 (this share), 0.1% and 0.3% (fill 0.92); at 8.1, 0.04% and 0.1%. The rest of the
#: cores are the serving stack's.
SHARE = 0.15
#: Above this scale a run still runs, but warns once, naming what the profile costs here: the
#: run takes that many times the device's time, and host-side latencies are that much smaller
#: against its bubbles (the figures report them at k = 1: `control_share_*`).
WARN_SCALE = 20.0
#: The largest scale `BUBBLETEA_TIME_SCALE` may name (a sanity bound, not a policy: a cap a user
#: wants is `--max-time-scale`).
LIMIT_SCALE = 1000.0


@dataclass(frozen=True)
class OpCost:
    """One profiled operation: what it costs here (median over processes computing at once) and
    what it counts for on the emulated device, both in milliseconds."""

    name: str
    real_ms: float
    profiled_ms: float

    @property
    def ratio(self) -> float:
        return self.real_ms / self.profiled_ms if self.profiled_ms > 0 else math.inf


@dataclass(frozen=True)
class Calibration:
    scale: float
    ops: tuple[OpCost, ...]
    processes: int
    why: str
    #: set above `WARN_SCALE`: what keeping the profile costs on this machine
    warning: str | None = None

    def line(self) -> str:
        """One line for the run's output."""
        costs = ", ".join(f"{o.name} {o.real_ms:.2f} ms real / {o.profiled_ms:.2f} ms profiled" for o in self.ops)
        return f"device time scale {self.scale:g} ({self.why}; {costs}; {self.processes} processes at once)"


def choose_scale(
    ops: list[OpCost], processes: int, share: float = SHARE, max_scale: float | None = None
) -> Calibration:
    """The smallest scale, at least 1 and rounded up to a tenth, at which every operation's real
    cost is within `share` of its scaled profiled time. Above `WARN_SCALE` it says what that costs
    (`Calibration.warning`); past a `max_scale` the user set, `ConfigError`."""
    if not ops:
        return Calibration(1.0, (), processes, "no device profile: every operation counts for its real time")
    worst = max(ops, key=lambda o: o.ratio)
    need = worst.ratio / share
    cost = (
        f"{worst.name} takes {worst.real_ms:.2f} ms of real compute with {processes} processes computing at "
        f"once, {worst.ratio:.1f}x its profiled {worst.profiled_ms:.2f} ms; keeping it within {share:.0%} "
        f"takes a time scale of {need:.1f}"
    )
    if max_scale is not None and need > max_scale:
        raise ConfigError(
            f"this machine cannot keep the device profile within --max-time-scale {max_scale:g}: {cost}; "
            "raise the cap, profile a slower device or a smaller model, or run on a quieter machine"
        )
    scale = max(1.0, math.ceil(need * 10) / 10)
    why = (
        f"{worst.name} needs {worst.ratio:.2f}x its profiled time here; scaled to keep it within {share:.0%}"
        if scale > 1
        else f"real compute within {share:.0%} of the profile without scaling"
    )
    warning = None
    if scale > WARN_SCALE:
        warning = (
            f"a slow or busy machine for this profile: {cost}, above {WARN_SCALE:g}; the run takes {scale:g}x "
            "the device's time (set a cap with --max-time-scale)"
        )
    return Calibration(scale, tuple(ops), processes, why, warning)


def field_clock(field_type: mi.Type) -> str | None:
    """The clock a spec field's type declares (`shared.config.fields.DEVICE`, `DEVICE_RATE`, `HOST`), if any;
    an optional field (`X | None`) declares it on X."""
    if isinstance(field_type, mi.UnionType):
        marks = {field_clock(t) for t in field_type.types} - {None}
        return marks.pop() if marks else None
    if isinstance(field_type, mi.Metadata):
        return (field_type.extra or {}).get("clock") or field_clock(field_type.type)
    return None


def spec_clocks(cls: type[msgspec.Struct] = ClusterSpec, prefix: str = "") -> dict[str, str | None]:
    """Every leaf field of the spec by its path (``bubbletea.guard_ms``, ``wan.links[].latency_ms``)
    and the clock it declares (None: not a duration): the table of docs/config.md, "Clocks"."""
    out: dict[str, str | None] = {}
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    for f in info.fields:
        inner = _struct_of(f.type)
        if inner is not None:
            many = "[]" if isinstance(f.type, mi.VarTupleType | mi.ListType) else ""
            out |= spec_clocks(inner, f"{prefix}{f.name}{many}.")
        else:
            out[f"{prefix}{f.name}"] = field_clock(f.type)
    return out


def _struct_of(t: mi.Type) -> type[msgspec.Struct] | None:
    if isinstance(t, mi.StructType):
        return t.cls
    if isinstance(t, mi.VarTupleType | mi.ListType):
        return _struct_of(t.item_type)
    return None


def scale_struct(value: S, k: float) -> S:
    """`value` (a spec or any of its sections) with every field of device time multiplied by `k`,
    every device rate divided by it, host times as they are; nested sections alike."""
    info = mi.type_info(type(value))
    assert isinstance(info, mi.StructType)
    changes: dict[str, object] = {}
    for f in info.fields:
        v = getattr(value, f.name)
        clock = field_clock(f.type)
        if v is None:
            continue
        if clock == "device":
            changes[f.name] = v * k
        elif clock == "device-rate":
            changes[f.name] = v / k
        elif isinstance(v, msgspec.Struct):
            changes[f.name] = scale_struct(v, k)
        elif isinstance(v, tuple) and v and all(isinstance(x, msgspec.Struct) for x in v):
            changes[f.name] = tuple(scale_struct(x, k) for x in v)
    return msgspec.structs.replace(value, **changes)


def scale_spec(spec: ClusterSpec, k: float) -> ClusterSpec:
    """The spec on a device (and WAN) `k` times slower: every field marked device time stretched,
    device rates slowed, host times kept (`scale_struct`; see the module docstring)."""
    return spec if k == 1 else scale_struct(spec, k)


def profile_ms(spec: ClusterSpec) -> tuple[float, float] | None:
    """(forward, backward) ms per layer per microbatch from the device profile, or None."""
    dev = spec.device
    if dev.fwd_ms_per_layer is None:
        return None
    return dev.fwd_ms_per_layer, dev.bwd_ms_per_layer or 2 * dev.fwd_ms_per_layer
