"""The checks every run command runs at start, and `check-config` runs alone: a spec that passes
them never fails a run at start (issue 37)."""

from __future__ import annotations

from shared.policies.placement import PlacementError
from shared.spec.config import ConfigError
from shared.spec.settings import Settings


def check_run(settings: Settings) -> None:
    """Raise ConfigError naming what a run of `settings` would refuse at start."""
    from shared.spec.plan import placement_of

    spec = settings.base_spec or settings.spec
    try:
        placement_of(spec)
    except PlacementError as exc:
        raise ConfigError(f"{settings.spec_path}: parallelism: {exc}") from None
