"""Behaviours the README and docs/ state, pinned where no other test pins them: the objective
`up`, compose and the deploy scripts state where the spec has none, the record TTL the API
promises, and that `bubbletea train` ends a run whose worker dies. (Where the others are pinned:
the resume source in test_recovery.py, the spec's missing objective and placement with a decoder
in test_config.py; docs/testing.md lists them.)"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bubbletea.cli_up import DEFAULT_OBJECTIVE_MS
from bubbletea.launcher.procs import ServiceFailed
from bubbletea.launcher.train import _follow
from shared.config.settings import load_settings
from shared.wire import keys

ROOT = Path(__file__).resolve().parents[2]


def test_up_compose_and_the_deploy_scripts_state_a_500_ms_objective_the_spec_leaves_out() -> None:
    """README, api.md, config.md and vllm.md: none in a spec; 500 ms under up, compose, deploy."""
    assert load_settings(env={}).spec.prefill.ttft_objective_ms is None
    assert DEFAULT_OBJECTIVE_MS == 500
    compose = (ROOT / "compose.yaml").read_text()
    assert "BUBBLETEA_TTFT_OBJECTIVE_MS: ${BUBBLETEA_TTFT_OBJECTIVE_MS:-500}" in compose
    slurm = (ROOT / "deploy" / "slurm" / "control.sbatch").read_text()
    assert 'BUBBLETEA_TTFT_OBJECTIVE_MS="${BUBBLETEA_TTFT_OBJECTIVE_MS:-500}"' in slurm
    k8s = (ROOT / "deploy" / "k8s" / "overlays" / "control" / "prefill-queue.yaml").read_text()
    assert re.search(r'name: BUBBLETEA_TTFT_OBJECTIVE_MS\n\s+value: "500"', k8s)


def test_answers_and_idempotency_keys_live_the_hour_the_api_says() -> None:
    """api.md: records live an hour (tests/integration/test_prefill_api.py reads the TTL Redis set)."""
    assert keys.PREFILL_RECORD_TTL_S == 3_600
    api = " ".join((ROOT / "docs" / "api.md").read_text().split())
    assert "live an hour (`keys.PREFILL_RECORD_TTL_S`" in api
    assert keys.PREFILL_READ_GRACE_S == 120
    assert "an answer its client has read goes 2 minutes later (`keys.PREFILL_READ_GRACE_S`)" in api


async def test_bubbletea_train_ends_the_run_when_a_worker_dies() -> None:
    """running.md: `train` starts no replacement; a worker that exits with an error ends the run."""
    dead: Any = SimpleNamespace(name="stage_worker-2", proc=SimpleNamespace(returncode=-9, pid=42), tail=["last"])
    with pytest.raises(ServiceFailed, match=r"stage_worker-2 \(pid 42\) exited with code -9"):
        await _follow(None, "events", load_settings(env={}), [dead], None, None)  # type: ignore[arg-type]
