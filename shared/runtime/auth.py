"""The API key check, one definition for every HTTP endpoint that asks for it (the front door's
API and, with `BUBBLETEA_METRICS_AUTH=on`, every service's `/metrics`)."""

from __future__ import annotations

import secrets


def bearer_ok(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header carries `key` as a bearer token. The scheme is
    case-insensitive (RFC 9110, 11.1); the key is compared in constant time."""
    scheme, _, given = authorization.strip().partition(" ")
    right_key = secrets.compare_digest(given.strip().encode(), key.encode())
    return right_key and scheme.lower() == "bearer"
