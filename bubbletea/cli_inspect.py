"""The `bubbletea` commands that look without running anything: `plan`, `check-config` and
`health`, each with `--json`. Every command reads its spec the same way: `--config FILE`, else
`$BUBBLETEA_CONFIG`, else `configs/demo.yaml` (`shared.config.settings.load_settings`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from bubbletea.cli_common import CONFIG_HELP, PREFIX, CommandError, add_spec_arguments
from bubbletea.launcher.services import SERVICES
from shared.config.settings import load_settings
from shared.config.spec import ClusterSpec, ConfigError

SERVICE_NAMES = tuple(svc.name for svc in SERVICES)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="print the placement, cross-DC hops and the analytic iteration time",
        description="The placement of the spec's stages on its datacenters (parallelism.placement: Atlas's or "
        "round-robin), the WAN hops, and the analytic "
        "pipeline model's iteration time and bubble fraction for each sharing policy.",
    )
    add_spec_arguments(p)
    p.add_argument(
        "--fwd-ms",
        type=float,
        default=10.0,
        help="forward ms per layer per microbatch when the spec has no device profile (default 10)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object instead")
    p.set_defaults(func=plan)

    p = sub.add_parser(
        "check-config",
        help="run every check a run command runs on a spec, without running anything",
        description="Load and validate a cluster spec, and run every check any run command (demo, up, train, "
        "plan, simulate) runs at start: the fields, the placement on the datacenters, the checkpoint, model and "
        "data paths, the model directory's family and tokenizer, duplicate keys, and the environment's "
        "BUBBLETEA_* variables. Exit 2 with one line naming the field or variable; a spec it passes never "
        "fails a run at start.",
    )
    add_spec_arguments(p)
    p.add_argument(
        "--show",
        action="store_true",
        help="print the spec in effect with every default filled in, as YAML that loads back unchanged (stdout; "
        "the summary line goes to stderr)",
    )
    p.add_argument("--json", action="store_true", help="print the result (and with --show the spec) as JSON")
    p.add_argument(
        "--shell",
        action="store_true",
        help="print what a batch script needs of the spec in effect as NAME=value lines to eval: HTTP_PORT (the "
        "front door's port, BUBBLETEA_HTTP_PORT in), DISPATCH (bubbletea.dispatch, BUBBLETEA_DISPATCH in) and "
        "DISPATCH_DCS (with per_dc, the datacenters a dispatcher serves, space-separated); the summary line goes "
        "to stderr (deploy/slurm/control.sbatch)",
    )
    p.set_defaults(func=check_config)

    p = sub.add_parser(
        "health",
        help="exit 0 if a service has a live heartbeat in Redis (REDIS_URL)",
        description="Check the heartbeat keys services refresh in Redis; used by compose healthchecks.",
    )
    p.add_argument("service", choices=SERVICE_NAMES, metavar="SERVICE", help=f"one of {', '.join(SERVICE_NAMES)}")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help='print {"service": ..., "live": [...]} (exit code unchanged)')
    p.add_argument(
        "--dc",
        metavar="DC",
        help="only instances serving datacenter DC (a dispatcher per datacenter: bubbletea.dispatch per_dc)",
    )
    p.set_defaults(func=health)


def plan(args: argparse.Namespace) -> int:
    from bubbletea.plan import plan_data, plan_report
    from bubbletea.preflight import check_run
    from shared.config.timescale import profile_ms

    settings = load_settings(args.config)
    spec = settings.base_spec or settings.spec
    check_run(settings)
    prof = profile_ms(spec)
    if prof is not None:
        fwd, bwd, source = prof[0], prof[1], "device profile"
    else:
        fwd, bwd, source = args.fwd_ms, args.fwd_ms * 2, f"--fwd-ms {args.fwd_ms} (no device profile in the spec)"
    if args.json:
        print(json.dumps(plan_data(spec, fwd, bwd, source)))
    else:
        print(plan_report(spec, fwd, bwd, source))
    return 0


def _summary(spec: ClusterSpec) -> dict[str, Any]:
    return {
        "datacenters": len(spec.datacenters),
        "gpus": sum(d.gpus for d in spec.datacenters),
        "pp": spec.parallelism.pp,
        "dp": spec.parallelism.dp,
        "tp": spec.parallelism.tp,
        "schedule": spec.training.schedule,
        "sharing": spec.wan.sharing,
    }


def check_config(args: argparse.Namespace) -> int:
    import shlex

    from bubbletea.preflight import check_run
    from shared.policies.pipeline_plan import dispatch_dcs

    if args.shell and (args.show or args.json):  # each of them owns stdout
        raise CommandError("--shell prints NAME=value lines alone: drop --show and --json")
    try:
        settings = load_settings(args.config)
        check_run(settings)
    except ConfigError as exc:
        if not args.json:
            raise
        print(json.dumps({"ok": False, "error": str(exc)}))
        print(f"{PREFIX}{exc}", file=sys.stderr)
        return 2
    spec = settings.base_spec or settings.spec  # what runs (environment overrides in), before the time scale
    s = _summary(spec)
    if args.json:
        out: dict[str, Any] = {"file": str(settings.spec_path), "ok": True, **s}
        if args.show:
            out["spec"] = msgspec.to_builtins(spec)
        print(json.dumps(out))
        return 0
    if args.shell:  # the port as the front door will bind it: the spec's, or BUBBLETEA_HTTP_PORT's
        print(f"HTTP_PORT={settings.spec.http.port}")
        dcs = [dc for dc in dispatch_dcs(settings.spec) if dc is not None]  # none with one dispatcher
        print(f"DISPATCH={settings.spec.bubbletea.dispatch}\nDISPATCH_DCS={shlex.quote(' '.join(dcs))}")
    if args.show:
        sys.stdout.write(msgspec.yaml.encode(spec).decode())
        sys.stdout.flush()
    print(
        f"{settings.spec_path}: ok ({s['datacenters']} datacenters, {s['gpus']} GPUs, "
        f"PP={s['pp']} DP={s['dp']} TP={s['tp']}, schedule={s['schedule']}, sharing={s['sharing']})",
        file=sys.stderr if args.show or args.shell else sys.stdout,
    )
    return 0


def health(args: argparse.Namespace) -> int:
    """Exit 0 if SERVICE has a live heartbeat in Redis (for compose healthchecks), else 1."""
    import asyncio

    from shared.bus.connection import client_for
    from shared.control.health import live_instances

    settings = load_settings(args.config)

    async def check() -> list[dict[str, object]]:
        r = client_for(settings.require_redis_url(), socket_timeout=None)
        try:
            return await live_instances(r, args.service)
        finally:
            await r.aclose()

    live = [i for i in asyncio.run(check()) if args.dc is None or i.get("dc") == args.dc]
    if args.json:
        print(json.dumps({"service": args.service, "live": live}, default=str))
    else:
        for inst in live:
            print(f"{args.service} {inst['instance']} ok")
    if not live:
        of = "" if args.dc is None else f" serving datacenter {args.dc}"
        print(f"{args.service}: no live instance{of} (no heartbeat in Redis)", file=sys.stderr)
    return 0 if live else 1
