"""One clock, declared: every duration of the spec says whether it is device time (stretched by the
time scale k) or host time (never stretched), the scale applies exactly that, docs/config.md lists
it, and the pure dispatch policy decides the same thing, in device time, at k as at 1."""

import random
import re
from pathlib import Path

import pytest

from shared.config.spec import ClusterSpec, parse_spec
from shared.config.timescale import scale_spec, spec_clocks
from shared.policies.decisions import Batch, Decisions
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import (
    BATCH_GRACE_S,
    RESUME_WAIT_S,
    STAGE_WINDOW_S,
    STALE_BUBBLE_S,
    TICK_S,
    BubbleClosed,
    BubbleOpened,
    Progress,
    Request,
    WorkerReady,
)

ROOT = Path(__file__).resolve().parents[2]
#: Field names that are durations or rates by their unit.
TIMED = re.compile(r"_(ms|s|us|us_per_token|gbps)$|_ms_per_layer$")


def test_every_duration_of_the_spec_declares_its_clock() -> None:
    clocks = spec_clocks()
    timed = {path for path in clocks if TIMED.search(path.rsplit(".", 1)[-1])}
    assert len(timed) >= 20
    undeclared = sorted(p for p in timed if clocks[p] is None)
    assert not undeclared, f"durations without a clock (shared.config.fields DEVICE / HOST): {undeclared}"
    assert {p for p, c in clocks.items() if c} == timed  # and nothing else claims one


def spec() -> ClusterSpec:
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "wan-bound.yaml").read_text())
    raw["device"] |= {"prefill_ms_per_layer": 0.25, "prefill_us_per_token": 8.0}
    raw["wan"]["links"] = [{"src": "dc-a", "dst": "dc-b", "latency_ms": 7.0, "bandwidth_gbps": 2.0}]
    return parse_spec(raw)


def test_the_time_scale_stretches_device_times_and_only_those() -> None:
    base, k = spec(), 3.0
    scaled = scale_spec(base, k)

    def value(s: ClusterSpec, path: str) -> object:
        obj: object = s
        for part in path.split("."):
            obj = getattr(obj, part[:-2])[0] if part.endswith("[]") else getattr(obj, part)
        return obj

    for path, clock in spec_clocks().items():
        before, after = value(base, path), value(scaled, path)
        if before is None or clock is None or clock == "host":
            assert after == before, path
        elif clock == "device":
            assert after == pytest.approx(before * k), path  # type: ignore[operator]
        else:
            assert clock == "device-rate"
            assert after == pytest.approx(before / k), path  # type: ignore[operator]
    assert scaled.bubbletea.max_credit_ms == pytest.approx(3 * base.bubbletea.max_credit_ms)  # the credit too
    assert scaled.prefill.request_timeout_s == pytest.approx(3 * base.prefill.request_timeout_s)
    assert scale_spec(base, 1) is base


def test_docs_config_lists_every_clock() -> None:
    """docs/config.md's "Clocks" table names every timed field and constant with its clock."""
    text = (ROOT / "docs" / "config.md").read_text()
    table = text.split("## Clocks", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([^`]+)` \| (device rate|device|host) \|", table, re.M))
    for path, clock in spec_clocks().items():
        if clock is not None:
            assert rows.get(path) == clock.replace("-", " "), path
    for const in ("STAGE_WINDOW_S", "BATCH_GRACE_S", "STALE_BUBBLE_S", "TICK_S", "RESUME_WAIT_S"):
        assert rows.get(const) == "device", const


def test_the_policy_windows_stretch_with_the_scale() -> None:
    s = DispatchState.from_spec(scale_spec(spec(), 5.0).bubbletea, 4, time_scale=5.0)
    assert (s.book.stage_window_s, s.book.batch_grace_s, s.stale_bubble_s, s.tick_s) == pytest.approx(
        (5 * STAGE_WINDOW_S, 5 * BATCH_GRACE_S, 5 * STALE_BUBBLE_S, 5 * TICK_S)
    )
    assert s.book.max_credit_s == pytest.approx(5 * spec().bubbletea.max_credit_ms / 1000)
    assert s.resume_wait_s == pytest.approx(5 * RESUME_WAIT_S)
    assert s.cost.predict(128) == pytest.approx(5 * DispatchState.from_spec(spec().bubbletea, 4).cost.predict(128))


def _view(ds: Decisions) -> tuple[object, ...]:
    """A decision with its times left out (those are compared scaled): who gets what, who fails."""
    return (
        tuple((b.batch_id, b.worker, tuple((i.id, i.from_layer, i.to_layer) for i in b.items)) for b in ds.batches),
        tuple((f.id, f.reason) for f in ds.failed),
        tuple((f.id, f.ticket) for f in ds.finished),
        tuple((lb.batch_id, lb.requests) for lb in ds.lost),
        tuple(ds.spent),
    )


#: Times are compared scaled, to within float rounding of sums.
TIME_TOL = 1e-9


def _times(ds: Decisions) -> list[float]:
    return [b.predicted_s for b in ds.batches] + [i.seconds for b in ds.batches for i in b.items]


@pytest.mark.parametrize("seed", range(3))
def test_the_dispatch_policy_decides_the_same_at_any_time_scale(seed: int) -> None:
    """The same inputs in device time, given at k = 1 and at k = 4 (every time k times longer), give
    the same decisions, their times k times longer. (k = 4: scaling by a power of two is exact in
    floating point, so no rounding can move a tie.)"""
    k = 4.0
    base = spec()
    one = DispatchState.from_spec(base.bubbletea, 4, time_scale=1.0)
    scaled = DispatchState.from_spec(scale_spec(base, k).bubbletea, 4, time_scale=k)
    timeout = base.prefill.request_timeout_s
    rnd = random.Random(seed)
    workers = [f"r{d}s{s}" for d in range(2) for s in range(2)]
    out: dict[str, Batch] = {}
    now, n, tags = 0.0, 0, dict.fromkeys(workers, 0)
    batches = 0
    for _ in range(1500):
        now += rnd.choice((0.0, 0.0005, 0.002, 0.01, 0.05, 0.5)) * rnd.random()
        op = rnd.random()
        if op < 0.35:
            n += 1
            tokens = rnd.choice((16, 64, 96, 200))
            deadline = now + timeout * rnd.choice((1.0, 0.01))
            calls = (
                "add_request",
                (Request(f"q{n}", tokens, now, 1000, deadline=deadline, ticket=f"t{n}", payload=None),),
                (Request(f"q{n}", tokens, now * k, 1000, deadline=deadline * k, ticket=f"t{n}", payload=None),),
            )
        elif op < 0.55:
            w = rnd.choice(workers)
            tags[w] += 1
            predicted, started = rnd.uniform(0.0, 0.06), now - rnd.choice((0.0, 0.0005, STALE_BUBBLE_S + 0.5))
            calls = (
                "bubble_start",
                (BubbleOpened(w, f"fill:{w}", predicted, 10**9, started, tags[w]),),
                (BubbleOpened(w, f"fill:{w}", predicted * k, 10**9, started * k, tags[w]),),
            )
        elif op < 0.7:
            w = rnd.choice(workers)
            actual = rnd.uniform(0.0, 0.06)
            done = tuple(b for b, x in out.items() if x.worker == w and rnd.random() < 0.3)
            got1 = one.bubble_end(BubbleClosed(w, tags[w], actual, done), now=now)
            gotk = scaled.bubble_end(BubbleClosed(w, tags[w], actual * k, done), now=now * k)
            assert _view(got1) == _view(gotk)
            assert _times(gotk) == pytest.approx([t * k for t in _times(got1)], abs=TIME_TOL)
            out.update({b.batch_id: b for b in got1.batches})
            continue
        elif op < 0.73:
            w = rnd.choice(workers)
            calls = (
                "worker_joined",
                (WorkerReady(w, f"fill:{w}", 0.03, 10**9, now),),
                (WorkerReady(w, f"fill:{w}", 0.03 * k, 10**9, now * k),),
            )
        elif op < 0.93 and out:
            b = out.pop(rnd.choice(sorted(out)))
            reached = [rnd.randint(i.from_layer, i.to_layer) for i in b.items]
            spent = [i.seconds * rnd.choice((0.5, 1.0, 2.0)) for i in b.items]
            report = [(i.id, x, t) for i, x, t in zip(b.items, reached, spent, strict=True)]
            calls = (
                "report",
                (b.batch_id, b.worker, [Progress(i, x, t) for i, x, t in report]),
                (b.batch_id, b.worker, [Progress(i, x, t * k) for i, x, t in report]),
            )
        else:
            calls = ("tick", (), ())
        name, args1, argsk = calls
        got1 = getattr(one, name)(*args1, now)
        gotk = getattr(scaled, name)(*argsk, now * k)
        assert _view(got1) == _view(gotk), name
        assert _times(gotk) == pytest.approx([t * k for t in _times(got1)], abs=TIME_TOL), name
        out.update({b.batch_id: b for b in got1.batches})
        for lb in got1.lost:
            out.pop(lb.batch_id, None)
        batches += len(got1.batches)
    assert batches > 100 and one.counts.expired > 0 and one.counts.done > 10  # it did decide things
