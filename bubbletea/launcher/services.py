"""The one table of BubbleTea's services: what each runs and how its health is checked.

`bubbletea demo`/`up` start processes from this table; `compose.yaml` must describe the same
services with the same commands (a test compares them), so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from bubbletea.launcher.wan_modes import WorkerLaunch
from shared.config.spec import ClusterSpec
from shared.policies.pipeline_plan import dispatch_dcs


@dataclass(frozen=True)
class ServiceDef:
    name: str
    #: Python module run as ``python -m MODULE`` (in compose: the container command).
    module: str
    #: Whether the service serves HTTP (then health is ``GET /health``); else its Redis heartbeat.
    http: bool = False
    #: Started once per pipeline slot (PP x DP processes) instead of once.
    per_slot: bool = False
    #: Scheduling niceness on a shared machine: the serving front door yields the CPU to the
    #: training processes (training is the owner), which matters when everything shares a few cores.
    nice: int = 0
    #: Started only when the spec turns decoding on (`decode.enabled`; compose: the decode profile).
    decode_only: bool = False
    #: Forked by the launchers from a server that has imported torch (`bubbletea/launcher/forked.py`):
    #: the services whose start is worth a fork. Compose, Kubernetes and Slurm run the module.
    forked: bool = False


PREFILL_QUEUE = ServiceDef("prefill_queue", "services.prefill_queue", http=True, nice=10)
WAN_BROKER = ServiceDef("wan_broker", "services.wan_broker")
STAGE_WORKER = ServiceDef("stage_worker", "services.stage_worker", per_slot=True, forked=True)
DISPATCHER = ServiceDef("dispatcher", "services.dispatcher")
DECODER = ServiceDef("decoder", "services.decoder", decode_only=True)

SERVICES: tuple[ServiceDef, ...] = (PREFILL_QUEUE, WAN_BROKER, STAGE_WORKER, DISPATCHER, DECODER)


def command(svc: ServiceDef) -> list[str]:
    """The command line (after the interpreter) that starts `svc`."""
    return ["-m", svc.module]


def instances(svc: ServiceDef, spec: ClusterSpec, launches: list[WorkerLaunch]) -> list[tuple[str, WorkerLaunch]]:
    """The processes of `svc` a launcher starts for `spec`, each with its label and launch: a stage
    worker per slot (`launches`, in slot order); a dispatcher per datacenter holding stages with
    `bubbletea.dispatch: per_dc` (BUBBLETEA_DC names it); one of anything else."""
    if svc.per_slot:
        return [(f"{svc.name}-{i}", launch) for i, launch in enumerate(launches)]
    if svc is DISPATCHER:
        dcs = [dc for dc in dispatch_dcs(spec) if dc is not None]
        if dcs:
            return [(f"{svc.name}-{dc}", WorkerLaunch(env={"BUBBLETEA_DC": dc})) for dc in dcs]
    return [(svc.name, WorkerLaunch())]
