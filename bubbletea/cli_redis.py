"""`bubbletea redis`: an embedded redis-server (or, with --cluster, an embedded Redis Cluster) for
running services by hand; and `bubbletea redis --form-cluster HOST:PORT,...`, which forms a Redis
Cluster out of running, empty, cluster-enabled nodes someone else started (compose services,
Kubernetes pods, hosts), waits until it serves, and exits (shared/runtime/cluster_form.py).

Tested by: tests/integration/test_cluster_form.py, tests/e2e/test_services_as_processes.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
from typing import Any
from urllib.parse import unquote, urlsplit

from bubbletea.cli_common import CommandError
from shared.runtime.cluster_form import FORM_TIMEOUT_S, Address, parse_addresses
from shared.runtime.logs import setup_logging


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "redis",
        help="run an embedded redis-server on a free port until Ctrl-C, or form a Redis Cluster of running nodes",
        description="Start a private redis-server (from the PATH or the packaged binary) and print its REDIS_URL, "
        "for running services by hand. With --form-cluster, start nothing: form a Redis Cluster out of running, "
        "empty, cluster-enabled nodes (redis-server --cluster-enabled yes), wait until it serves, print its "
        "REDIS_URL and exit; nodes already formed into one cluster are left as they are (and said so). Their "
        "password, if they ask for one, is REDIS_URL's (redis+cluster://:PASSWORD@host:port).",
    )
    p.add_argument("--port", type=_port, default=None, help="port to listen on (default: a free one)")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="start a Redis Cluster instead (3 masters, 1 replica each, on free ports); prints its "
        "redis+cluster:// URL and each node's port, pid and role",
    )
    p.add_argument(
        "--form-cluster",
        metavar="HOST:PORT,...",
        type=_addresses,
        help="form a cluster of these running nodes (the first ones become the masters) and exit",
    )
    p.add_argument(
        "--replicas",
        type=_count,
        default=None,
        help="with --form-cluster: replicas per master (default 1; the nodes must be a multiple of 1 + this)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"with --form-cluster: seconds the forming may take (default {FORM_TIMEOUT_S:g})",
    )
    p.set_defaults(func=_redis)


def _port(value: str) -> int:
    """An argparse type: a TCP port a server can listen on."""
    if not value.isdigit() or not 1 <= int(value) <= 65_535:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {value!r}")
    return int(value)


def _addresses(value: str) -> list[Address]:
    try:
        return parse_addresses(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value!r}")
    return int(value)


def _redis(args: argparse.Namespace) -> int:
    if args.form_cluster is not None:
        if args.port is not None or args.cluster:
            raise CommandError("--form-cluster forms nodes already running: not with --port or --cluster", 2)
        return _form(args.form_cluster, 1 if args.replicas is None else args.replicas, args.timeout)
    if args.replicas is not None or args.timeout is not None:
        raise CommandError("--replicas and --timeout go with --form-cluster", 2)
    return _serve(args)


def _form(nodes: list[Address], replicas: int, timeout: float | None) -> int:
    from shared.runtime.cluster_form import form_cluster

    setup_logging("redis", "WARNING")
    username, password = _credentials(os.environ.get("REDIS_URL"))
    formed = form_cluster(
        nodes,
        replicas=replicas,
        username=username,
        password=password,
        timeout=FORM_TIMEOUT_S if timeout is None else timeout,
    )
    shape = f"{formed.masters} masters, {formed.replicas} replicas"
    if formed.new:
        print(f"formed a Redis Cluster of {len(nodes)} nodes: {shape}", flush=True)
    else:
        print(f"already one Redis Cluster ({shape}, state ok): left as it is", flush=True)
    print(f"REDIS_URL=redis+cluster://{nodes[0]}", flush=True)
    return 0


def _credentials(url: str | None) -> tuple[str | None, str | None]:
    """The user and password of REDIS_URL, which the nodes ask for (none: no AUTH)."""
    if not url:
        return None, None
    parts = urlsplit(url)
    if parts.scheme.startswith("rediss"):
        raise CommandError("--form-cluster speaks plain TCP to the nodes: not TLS (REDIS_URL is rediss...)", 2)
    user = unquote(parts.username) if parts.username else None
    return user, unquote(parts.password) if parts.password is not None else None


def _serve(args: argparse.Namespace) -> int:
    from shared.runtime.redis_cluster import EmbeddedCluster
    from shared.runtime.redis_server import EmbeddedRedis

    if args.port is not None:  # taken? say so in one line, before redis-server says it in twenty
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", args.port))
            except OSError as exc:
                why = exc.strerror or str(exc)
                raise CommandError(
                    f"--port {args.port}: {why}: choose another port, or leave --port out for one", 1
                ) from None
    setup_logging("redis", "WARNING")
    server: EmbeddedRedis | EmbeddedCluster
    if args.cluster:
        if args.port is not None:
            raise CommandError("--port names one server's port: not with --cluster (its nodes take free ports)", 2)
        server = EmbeddedCluster().start()
    else:
        server = EmbeddedRedis(port=args.port).start()
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    try:
        # Blocked after the servers started: a child inherits the blocked mask, and a redis-server
        # with SIGTERM blocked ignores its stop (then is SIGKILLed 5 s later). Delivered to sigwait.
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        print(f"REDIS_URL={server.url}", flush=True)
        if isinstance(server, EmbeddedCluster):
            for node in server.nodes():
                print(f"# node 127.0.0.1:{node.port} pid={node.pid} {node.role}", flush=True)
        signal.sigwait(stop_signals)
    finally:
        server.stop()
    return 0
