"""API keys and per-key rate limits for the /v1 routes.

Keys are configured hashed (`auth.api_keys: [{id, sha256}]`); when any are
set, every /v1 route needs `Authorization: Bearer <key>`, and a job is visible
only to the key that created it. Each key's rate is admission's to limit (app.admission's `limit_rate`: a
token bucket in Redis, `auth.rate_per_s`, `auth.burst`); an empty bucket answers 429 + Retry-After.

    python -m app.auth <key>        # prints the sha256 to put in the config
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from typing import Any

from flask import g, request

from app.problems import Problem
from app.services import services as current_services


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def install(app) -> None:
    services = current_services(app)

    @app.before_request
    def authenticate() -> None:
        g.client_id = None
        settings = services.settings.auth
        # /metrics too, where it is served on this port (api.metrics_port 0): every tenant's job counts.
        if not (request.path.startswith("/v1/") or request.path == "/metrics") or not settings.api_keys:
            return
        try:
            g.client_id = _client_for(request.headers.get("Authorization", ""), settings.api_keys)
        except Problem:
            # An address that fails too often is refused outright (app.admission counts it).
            refused = services.admission.failed_authentication(request.remote_addr or "-")
            if refused is not None:
                raise refused from None
            raise
        if request.path == "/metrics":  # every tenant's job counts: an admin key's (app.metrics serves it)
            require_admin(settings.api_keys)
        services.admission.limit_rate(g.client_id)  # a 429 past the key's auth.rate_per_s


def _client_for(header: str, api_keys) -> str:
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Problem(
            401,
            "unauthorized",
            "Unauthorized",
            "send Authorization: Bearer <api key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    client = key_id(header, api_keys)
    if client is None:
        raise Problem(401, "unauthorized", "Unauthorized", "unknown API key", headers={"WWW-Authenticate": "Bearer"})
    return client


def key_id(header: str, api_keys: Iterable[Mapping[str, Any]]) -> str | None:
    """The id of the API key an Authorization header carries (`Bearer <key>`), or None: the one lookup of a key
    (this module's, and app.early_refusal's before Flask). Every configured key is compared, in constant time
    each, and the first that matches is the key's."""
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key:
        return None
    digest, found = hash_key(key.strip()), None
    for entry in api_keys:
        if hmac.compare_digest(digest, str(entry["sha256"])) and found is None:
            found = str(entry["id"])
    return found


def is_admin(api_keys) -> bool:
    """Whether this request may see figures about every tenant's traffic: without keys anyone, with keys an
    `admin: true` key."""
    client_id = g.get("client_id")
    if client_id is None:
        return not api_keys
    return any(str(entry["id"]) == client_id and entry.get("admin") for entry in api_keys)


def require_admin(api_keys) -> None:
    """With keys, only an `admin: true` key may read figures about every tenant's traffic."""
    if not is_admin(api_keys):
        raise Problem(403, "forbidden", "Forbidden", "this route shows every tenant's traffic: it needs an admin key")


def owns(record: Mapping[str, Any]) -> bool:
    """Without keys every job is everyone's; with keys, only its creator's."""
    client_id = g.get("client_id")
    return client_id is None or record.get("owner") == client_id


def main(argv: list[str] | None = None) -> None:
    """`python -m app.auth KEY`: the sha256 to configure for an API key."""
    parser = argparse.ArgumentParser(
        prog="python -m app.auth",
        description="Print the sha256 of an API key, for auth.api_keys' `sha256` (the key itself is never stored).",
    )
    parser.add_argument("key", help="the API key its clients will send as `Authorization: Bearer <key>`")
    print(hash_key(parser.parse_args(argv).key))


if __name__ == "__main__":
    main()
