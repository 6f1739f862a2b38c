"""bench/takeover.py's figures: kill to the slot leased by the spare and to training again, every kill."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from bench import takeover


def _line(at: float, msg: str) -> str:
    stamp = datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f'ts={stamp} level=info svc=stage_worker logger=services.stage_worker.lease msg="{msg}" slot=r1s0\n'


def test_every_kill_counts_and_a_spare_that_never_took_a_slot_has_no_time(tmp_path: Path) -> None:
    t0 = 1_800_000_000.0
    logs = []
    for i, leased_after in enumerate((0.5, 1.5, None)):
        log = tmp_path / f"spare-{i}.log"
        text = _line(t0 + 100 * i, "spare ready")
        if leased_after is not None:
            text += _line(t0 + 100 * i + leased_after, "slot leased by a spare")
        log.write_text(text)
        logs.append(log)
    kills = [
        {"at": t0 + 100 * i, "generation": gen, "spare_log": log, "survived": i < 2, "lease_left_ms": 2500}
        for i, (log, gen) in enumerate(zip(logs, (1, 2, 4), strict=True))
    ]
    # generation 2 joined by all 4 slots 1.0 s after the first kill, 3 by 3 of 4 only, 4 by all; none after
    # the third kill
    joined = {2: [t0 + 0.8, t0 + 0.9, t0 + 1.0, t0 + 0.7], 3: [t0 + 101.0] * 3, 4: [t0 + 102.0] * 4}
    out = takeover.figures(kills, joined, slots=4)
    assert out["kills"] == 3 and out["survived"] == 2
    # the third spare never leased; the p50 of two is their mean (one percentile rule, the median's)
    assert out["taken_p50_s"] == 1.0 and out["taken_max_s"] == 1.5
    # the first later generation every slot joined; the third kill's run never trained again: it
    # counts, as infinite (issue 62: dropped, it left the figures of a run that always recovered)
    assert out["back_p50_s"] == 2.0 and out["back_max_s"] == "inf"
    assert out["lease_left_at_kill_p50_s"] == 2.5


def test_side_by_side_is_liveness_over_expiry() -> None:
    ratios = takeover.side_by_side(
        {"liveness": {"taken_p50_s": 1.0, "back_p50_s": 1.5}, "expiry": {"taken_p50_s": 3.0, "back_p50_s": 3.0}}
    )
    assert ratios == {"taken_p50_liveness_over_expiry": 0.333, "back_p50_liveness_over_expiry": 0.5}
    assert takeover.side_by_side({"liveness": {"taken_p50_s": 1.0}})["taken_p50_liveness_over_expiry"] is None
