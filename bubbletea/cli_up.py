"""`bubbletea up`: its options and how they become the spec and settings `run_up` gets
(`bubbletea.launcher.up` runs it)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from bubbletea.cli_common import (
    CommandError,
    add_scale_argument,
    add_spec_arguments,
    add_wan_argument,
    run_id_argument,
    scale_override,
    wan_override,
)
from bubbletea.preflight import check_run
from shared.config.env_values import objective_ms
from shared.config.settings import Settings, load_settings
from shared.config.spec import ClusterSpec, ConfigError, check_decode
from shared.config.training import UNTIL_STOPPED
from shared.runtime.logs import setup_logging

#: The TTFT objective `up` serves with when neither the spec nor --ttft-objective-ms names one
#: (device ms): an interactive objective vLLM alone meets on the bench machine (docs/vllm.md).
DEFAULT_OBJECTIVE_MS = 500


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "up",
        help="run the whole system as local processes (one training run with prefill serving)",
        description="Start Redis (embedded unless REDIS_URL is set), the WAN broker, the dispatcher, the "
        "prefill front door and one stage worker per pipeline slot; wait until each is healthy and serving is "
        "ready; print the API URL and every service's /metrics. Training (and so serving) goes on until Ctrl-C, "
        "whatever training.iterations the spec says, unless --iterations N is given. Stops on Ctrl-C, when a "
        "process dies (naming it), or when a finite run finishes; then writes the run folder (spans, summary, "
        "pictures). Like demo, it first picks the device time scale (BUBBLETEA_TIME_SCALE=K sets it).",
    )
    add_spec_arguments(p)
    p.add_argument("--run", type=run_id_argument, help="run id scoping streams and leases (default: up-<unix time>)")
    add_wan_argument(p)
    add_scale_argument(p)
    p.add_argument("--out", default="runs", help="where the run folder goes (default: runs/)")
    p.add_argument("--host", help="the API's address (default: the spec's http.host; as BUBBLETEA_HTTP_HOST)")
    p.add_argument(
        "--port",
        type=int,
        help="the API's port, 0 = any free one (default: the spec's http.port; as BUBBLETEA_HTTP_PORT)",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/ (as BUBBLETEA_API_KEY; docs/api.md). The key is visible "
        "to other users in the process list: on a shared host set BUBBLETEA_API_KEY instead",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="the model to serve, as vllm serve takes it: a local Hugging Face directory with weights "
        "(prefill.checkpoint; nothing is downloaded)",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the name clients ask for and /v1/models lists (prefill.model_name), as vllm serve's",
    )
    p.add_argument(
        "--iterations",
        type=int,
        help="train this many iterations, then stop (default: train and serve until Ctrl-C)",
    )
    p.add_argument(
        "--decode",
        nargs="?",
        const="builtin",
        choices=("builtin", "vllm"),
        help="answer whole completions (max_tokens > 1), prefilled in the bubbles and decoded from the KV "
        "cache (decode.enabled): by the decoder service up starts (builtin, the default), or by the vLLM "
        "server at --vllm-url with the BubbleTea KV connector (vllm; docs/vllm.md)",
    )
    p.add_argument(
        "--ttft-objective-ms",
        metavar="MS",
        help=f"the TTFT objective of a request that names none (prefill.ttft_objective_ms; default: the "
        f"spec's, else {DEFAULT_OBJECTIVE_MS} device ms; none: no objective): a prompt the bubbles cannot "
        "compute by it goes to vLLM (--decode vllm) or is refused at once with a 429 (docs/vllm.md)",
    )
    p.add_argument(
        "--vllm-url",
        help="the vLLM server (with the BubbleTea connector) that decodes with --decode vllm, e.g. "
        "http://127.0.0.1:8100 (decode.vllm_url); without it, up starts one serving prefill.checkpoint",
    )
    p.add_argument(
        "--vllm-python",
        help="the python of the vLLM environment up starts vLLM with (default: .venv-vllm/bin/python, from make vllm)",
    )
    p.add_argument(
        "--persist",
        action="store_true",
        help="run the embedded Redis with an append-only file (fsync always) in <run folder>/redis, so a "
        "restart of it loses no accepted request (default: off, or $BUBBLETEA_REDIS_PERSIST=1; ignored "
        "with REDIS_URL, whose server has its own settings)",
    )
    cluster_help = "run on an embedded Redis Cluster, 3 masters x 1 replica (not with REDIS_URL or --persist)"
    p.add_argument("--redis-cluster", action="store_true", help=cluster_help)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    wan_override(args)
    scale_override(args)
    import dataclasses

    from bubbletea.launcher.up import run_up

    if args.port is not None and not 0 <= args.port <= 65_535:
        raise CommandError(f"--port: expected a port number from 0 to 65535, got {args.port}")
    # as vllm serve takes them; here and in every service up starts: through the environment
    for value, var in (
        (args.host, "BUBBLETEA_HTTP_HOST"),
        (args.port, "BUBBLETEA_HTTP_PORT"),
        (args.api_key, "BUBBLETEA_API_KEY"),
    ):
        if value is not None:
            os.environ[var] = str(value)
    settings = load_settings(args.config)
    settings = _served(settings, args.model, args.served_model_name)
    check_run(settings)  # what check-config checks, before anything starts
    if args.run:
        settings = dataclasses.replace(settings, run=args.run)
    if args.iterations is not None and args.iterations < 1:
        raise ConfigError(f"--iterations must be >= 1, got {args.iterations}")
    # A service: it trains (and so serves) until stopped, whatever the spec says, unless told a number.
    iterations = args.iterations if args.iterations is not None else UNTIL_STOPPED

    spec = settings.spec
    # --decode vllm without a vLLM's URL: up starts one itself (bubbletea.launcher.vllm), with the
    # python of vLLM's environment; its URL replaces this placeholder once it is up.
    start_vllm = args.decode == "vllm" and not (args.vllm_url or spec.decode.vllm_url)
    vllm = None
    if start_vllm:
        from bubbletea.launcher.vllm import served_model_dir, vllm_python

        vllm = vllm_python(args.vllm_python)
        served_model_dir(spec)

    def adjusted(spec: ClusterSpec) -> ClusterSpec:
        spec = msgspec.structs.replace(spec, training=msgspec.structs.replace(spec.training, iterations=iterations))
        if args.ttft_objective_ms is not None or spec.prefill.ttft_objective_ms is None:  # a service states one
            given = args.ttft_objective_ms if args.ttft_objective_ms is not None else str(DEFAULT_OBJECTIVE_MS)
            objective = objective_ms(given, "--ttft-objective-ms")
            spec = msgspec.structs.replace(
                spec, prefill=msgspec.structs.replace(spec.prefill, ttft_objective_ms=objective)
            )
        if args.decode:
            d = msgspec.structs.replace(spec.decode, enabled=True, engine=args.decode)
            spec = msgspec.structs.replace(spec, decode=d)
        url = args.vllm_url or ("http://127.0.0.1:0" if start_vllm else None)
        if url:
            spec = msgspec.structs.replace(spec, decode=msgspec.structs.replace(spec.decode, vllm_url=url))
        check_decode(spec)
        return spec

    settings = settings.with_spec(adjusted)
    setup_logging("up", "WARNING")
    persist = args.persist or os.environ.get("BUBBLETEA_REDIS_PERSIST", "").lower() in ("1", "true", "yes", "on")
    return uvloop.run(
        run_up(
            settings,
            out_root=Path(args.out),
            verbose=args.verbose,
            persist=persist,
            vllm_python=vllm,
            redis_cluster=args.redis_cluster,
        )
    )


def _served(settings: Settings, model: str | None, name: str | None) -> Settings:
    """`--model PATH` and `--served-model-name NAME` into the spec (`prefill.checkpoint`, made
    absolute: the services read the spec from the run folder; `prefill.model_name`)."""
    if model is None and name is None:
        return settings

    def served(spec: ClusterSpec) -> ClusterSpec:
        prefill = spec.prefill
        if model is not None:
            prefill = msgspec.structs.replace(prefill, checkpoint=str(Path(model).expanduser().absolute()))
        if name is not None:
            prefill = msgspec.structs.replace(prefill, model_name=name)
        return msgspec.structs.replace(spec, prefill=prefill)

    return settings.with_spec(served)
