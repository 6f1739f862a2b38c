# PYTHON_ARGCOMPLETE_OK  (argcomplete's marker: shell completion, docs/running.md)
"""The `bubbletea` command's entry point: what every error looks like to the user.

A mistake the user can make (a bad spec or environment variable, Redis unreachable, a port taken,
a full disk, a closed pipe, Ctrl-C) ends in one line under `PREFIX` and a non-zero exit; only a
bug shows a traceback, and only with -v (without, one line says to rerun with -v). The
subcommands themselves are in `bubbletea.commands`, imported inside `main`, so that even Ctrl-C
while they import ends in one line.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Sequence

PREFIX = "bubbletea: error: "  # = bubbletea.cli_common.PREFIX (not imported: this module imports nothing of ours)
#: Exit codes: 1 the job failed (Redis unreachable, a service died, a disk full), 2 a usage or
#: configuration error (argparse's convention), 130 interrupted (Ctrl-C), 141 a closed pipe
#: (128 + SIGPIPE, as a coreutils tool killed by it).
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 1, 2, 130, 141

#: OS errors that are the machine's state, not a bug: each said with its path and what to do.
_OS_HINTS = {
    errno.ENOSPC: "free some space, or write elsewhere (--out DIR)",
    errno.EDQUOT: "free some space, or write elsewhere (--out DIR)",
    errno.EROFS: "write elsewhere (--out DIR)",
    errno.EACCES: "check its permissions, or write elsewhere (--out DIR)",
    errno.EPERM: "check its permissions, or write elsewhere (--out DIR)",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path",
    errno.EISDIR: "check the path",
    errno.EEXIST: "choose another path",
    errno.EADDRINUSE: "choose another port, or stop what uses it",
    errno.EMFILE: "raise the open-files limit (ulimit -n)",
}


def _verbose(argv: Sequence[str]) -> bool:
    return any(a in ("-v", "--verbose") or (a.startswith("-v") and set(a[1:]) == {"v"}) for a in argv)


def _describe(exc: BaseException, out: str | None = None) -> tuple[int, str] | None:
    """(exit code, the line) for an error a user can make; None for a bug. `out`: where the
    command writes (its --out), named when the error does not name its file (a full disk)."""
    from redis.exceptions import AuthenticationError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from bubbletea.cli_common import CommandError
    from bubbletea.launcher.kernel_wan import KernelWanError
    from bubbletea.launcher.procs import ServiceFailed
    from shared.config.model_info import CheckpointError
    from shared.config.spec import ConfigError
    from shared.policies.placement import PlacementError
    from shared.runtime.redis_server import RedisServerError

    if isinstance(exc, CommandError):
        return exc.code, str(exc)
    if isinstance(exc, (ConfigError, PlacementError, CheckpointError, KernelWanError)):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, (ServiceFailed, RedisServerError)):
        return EXIT_FAILED, str(exc)
    url = os.environ.get("REDIS_URL")
    where = f" at {_mask(url)} (REDIS_URL)" if url else ""
    if isinstance(exc, AuthenticationError):  # a subclass of ConnectionError: said first
        return EXIT_FAILED, f"Redis{where} refused us: {str(exc).rstrip('.')}; check the password in REDIS_URL"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return EXIT_FAILED, (
            f"cannot reach Redis{where}: {str(exc).rstrip('.')}; start it (`bubbletea redis` runs one) or point "
            "REDIS_URL at a running server"
        )
    if isinstance(exc, OSError) and exc.errno in _OS_HINTS:
        what = f"{exc.filename}: " if exc.filename is not None else f"writing under {out}: " if out else ""
        return EXIT_FAILED, f"{what}{exc.strerror or exc}: {_OS_HINTS[exc.errno]}"
    return None


def _mask(url: str) -> str:
    from shared.config.settings import mask_url

    return mask_url(url)


def _run(argv: list[str], seen: dict[str, str]) -> int:
    """Run the command; `seen["out"]`: where it writes (said if a write fails without a file name)."""
    if argv[:1] == ["report"]:  # its own parser (bubbletea.report.command) owns the arguments
        from bubbletea.report import main as report_main

        rest = argv[1:]
        seen["out"] = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--out"), "the run folder")
        return report_main(rest)
    from bubbletea.cli_common import merge_spec_argument
    from bubbletea.commands import build_parser

    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (register-python-argcomplete bubbletea)
        import argcomplete

        argcomplete.autocomplete(parser)  # prints them and exits
    if not [a for a in argv if a not in ("-v", "--verbose")]:  # bare `bubbletea`: what it can do, not an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    merge_spec_argument(args)  # `bubbletea plan SPEC` is `bubbletea plan --config SPEC`
    if getattr(args, "out", None):
        seen["out"] = str(args.out)
    return int(args.func(args))


def _stop_fork_server() -> None:
    """A command that forked its workers (train, up, demo) waits for its fork server and resource
    tracker to exit before it returns (bubbletea/launcher/forked.py)."""
    forked = sys.modules.get("bubbletea.launcher.forked")
    if forked is not None:
        forked.shutdown()


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so the interpreter's last flush is silent."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        _stop_fork_server()


def _quiet_warnings(verbose: bool) -> None:
    """Python warnings are log records (logger `py.warnings`): a dependency's warning never stands
    in place of the command's one line on a user's terminal; -v shows them."""
    import logging

    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.DEBUG if verbose else logging.ERROR)


def _main(argv: list[str]) -> int:
    verbose = _verbose(argv)
    _quiet_warnings(verbose)
    seen: dict[str, str] = {}
    try:
        try:
            return _run(argv, seen)
        except BrokenPipeError:  # `bubbletea plan | head -2`: the reader left; say nothing, as coreutils do
            _quiet_stdout()
            return EXIT_PIPE
        except KeyboardInterrupt:
            print("bubbletea: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as exc:
            said = _describe(exc, seen.get("out"))
            if said is None:
                if verbose:
                    raise
                print(
                    f"{PREFIX}internal error: {type(exc).__name__}: {exc} (a bug: rerun with -v for the traceback, "
                    "and report it)",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            code, line = said
            print(f"{PREFIX}{line}", file=sys.stderr)
            return code
    except KeyboardInterrupt:  # a second Ctrl-C while the first was handled
        print("bubbletea: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
