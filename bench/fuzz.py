"""Fuzz the prefill front door from its own OpenAPI description (schemathesis + hypothesis).

Starts an embedded redis-server and the real app (`services.prefill_queue.app.Runner`, as
`python -m services.prefill_queue` serves it) on a free port, reads ``/openapi.json``, and sends
generated requests, valid and invalid, to every operation. A case fails as a **server error** when
it gets a 500, or a 5xx the schema does not declare for the operation (a 503/504 the schema
declares is the service's explicit answer: not serving now, no answer in time); as a **schema
mismatch** when the status code, content type or body does not match the description.

    .venv/bin/python bench/fuzz.py [--cases 10000] [--seed 0]

prints progress on stderr and, last, one JSON line:
``{"cases": ..., "server_errors": 0, "schema_mismatches": 0, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hypothesis
import schemathesis
from hypothesis import HealthCheck, Phase, given
from msgspec.structs import replace
from schemathesis.specs.openapi import checks as oas_checks
from schemathesis.specs.openapi import schemas as _oas_schemas  # noqa: F401

# ^ Imported here, not lazily by `schemathesis.openapi.from_url` inside `fuzz`: that ran while the
# front door served in its thread (`serving`), and CPython 3.11's AST validator keeps its recursion
# depth in shared state, so two threads compiling at once (pytest rewrites imported modules) fail
# with "SystemError: AST constructor recursion depth mismatch" (seen in a full `make test`).
from services.prefill_queue.app import create_app
from services.prefill_queue.server import Runner
from shared.config.settings import Settings, load_settings
from shared.service.main import serve_app

SCHEMA_CHECKS = [
    oas_checks.status_code_conformance,
    oas_checks.content_type_conformance,
    oas_checks.response_schema_conformance,
]


def fuzz_settings(redis_url: str) -> Settings:
    """Small limits so that generated requests reach every answer fast (full queue, timeouts)."""
    s = load_settings(env={"REDIS_URL": redis_url})
    prefill = replace(s.spec.prefill, max_queue_depth=3, request_timeout_s=0.05, max_body_bytes=1 << 16)
    return Settings(**{**s.__dict__, "spec": replace(s.spec, prefill=prefill)})


@contextlib.contextmanager
def serving(settings: Settings) -> Iterator[str]:
    """The real front door in a background thread (its own event loop); yields its URL."""
    ready = threading.Event()
    urls: list[str] = []
    state: dict[str, Any] = {}

    def on_listening(url: str) -> None:
        urls.append(url)
        ready.set()

    async def main() -> None:
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        app = create_app(settings)
        await serve_app(app, "127.0.0.1", 0, state["stop"], on_listening=on_listening, runner_class=Runner)

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="front-door", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the front door did not start")
    try:
        yield urls[0]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(30)


#: Passes over the operations at most: hypothesis stops an operation early when its inputs run out
#: (`GET /health` has one), so a pass falls short of its share; the next pass, with the next seed,
#: spreads what is left.
MAX_PASSES = 20


def fuzz(base_url: str, cases: int, seed: int = 0) -> dict[str, Any]:
    """Send at least `cases` generated requests spread over the operations; count failures."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    totals: dict[str, Any] = {"cases": 0, "server_errors": 0, "schema_mismatches": 0, "statuses": {}, "examples": []}
    passes = 0
    while totals["cases"] < cases and passes < MAX_PASSES:
        per_op = max(1, (cases - totals["cases"]) // len(operations))
        for op in operations:
            t0 = time.perf_counter()
            _fuzz_operation(op, base_url, per_op, seed + passes, totals)
            print(f"pass {passes} {op.method.upper()} {op.path}: {totals['cases']} cases so far, "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)  # fmt: skip
        passes += 1
    totals["passes"] = passes
    return totals


def _fuzz_operation(op: Any, base_url: str, examples: int, seed: int, totals: dict[str, Any]) -> None:
    declared = {int(code) for code in op.definition.raw.get("responses", {}) if code.isdigit()}
    positive = op.as_strategy(schemathesis.GenerationMode.POSITIVE)
    strategy = positive | op.as_strategy(schemathesis.GenerationMode.NEGATIVE)

    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, timeout=10)
        totals["cases"] += 1
        status = response.status_code
        totals["statuses"][str(status)] = totals["statuses"].get(str(status), 0) + 1
        if status == 500 or (status >= 500 and status not in declared):
            totals["server_errors"] += 1
            _example(totals, op, case, f"HTTP {status}: {response.text[:200]}")
        try:
            case.validate_response(response, checks=SCHEMA_CHECKS)
        except Exception as exc:
            totals["schema_mismatches"] += 1
            _example(totals, op, case, str(exc).splitlines()[0] if str(exc) else repr(exc))

    run()


def _example(totals: dict[str, Any], op: Any, case: Any, why: str) -> None:
    if len(totals["examples"]) < 10:
        totals["examples"].append({"operation": f"{op.method.upper()} {op.path}", "body": repr(case.body)[:200],
                                   "why": why})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.getLogger("services").setLevel(logging.ERROR)  # every 4xx is an info line, 503/504 warnings
    from shared.runtime.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    t0 = time.perf_counter()
    try:
        with serving(fuzz_settings(server.url)) as url:
            totals = fuzz(url, args.cases, args.seed)
    finally:
        server.stop()
    totals["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(totals))
    return 0 if totals["server_errors"] == 0 and totals["schema_mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
