"""What `make run` (scripts/run-local) needs of the settings, as shell assignments: `eval "$(python -m
tools.run_settings)"` sets `redis_url`, `api_url`, `api_bind` and `api_metrics` (host:port, empty when /metrics is
on the API's port), `callback_secret_set` (1 or 0), `callback_key_secrets` (each API key's, when keys are set),
`callback_allow_hosts`, `redis_sentinels` and `bulk_shards` (space-separated; empty: none) and `configured_cells`
(how many cells the settings name; 0: none), and exports `.env`'s variables that the environment does not set
(compose's rule, as the supervisor reads it: tools.procfile), naming them in `dotenv_names`. Read by
contract.settings.config as every process reads them, `.env` included, so a settings file or variable that does not load
stops `make run` before anything starts, and the ready line names what the processes will use."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from contract.settings.config import load_settings
from tools.procfile import parse_env


def api_url(bind: str) -> str:
    """Where a client on this machine reaches gunicorn's `bind`: a wildcard address is reached at loopback."""
    if bind.startswith(("unix:", "fd://")):
        return bind  # not reached over TCP: no URL to print or poll
    host, _, port = bind.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"


def key_callback_secrets(api_keys: tuple[Any, ...]) -> str:
    """Where each API key's callback secret comes from, for make run's ready line: with keys set, a job's callbacks
    are signed with its key's own secret and the deployment's (var/callback-secret) signs nothing. '' without keys."""
    parts = []
    for entry in api_keys:
        if entry.get("callback_secret_env"):
            source = f"${entry['callback_secret_env']}"
        elif entry.get("callback_secret_file"):
            source = str(entry["callback_secret_file"])
        else:
            source = "none, so its callback_url is refused"
        parts.append(f"{entry['id']}: {source}")
    return "; ".join(parts)


def dotenv_additions(dotenv: Path, environ: dict[str, str]) -> dict[str, str]:
    """`.env`'s variables that the environment does not set."""
    if not dotenv.is_file():
        return {}
    return {name: value for name, value in parse_env(dotenv.read_text()).items() if name not in environ}


def main() -> int:
    added = dotenv_additions(Path(".env"), dict(os.environ))
    os.environ.update(added)  # the settings as the processes will read them
    settings = load_settings()
    for name, value in added.items():
        print(f"export {name}={shlex.quote(value)}")
    print(f"dotenv_names={shlex.quote(' '.join(added))}")
    print(f"redis_url={shlex.quote(settings.redis_url)}")
    print(f"api_url={shlex.quote(api_url(settings.api.bind))}")
    print(f"api_bind={shlex.quote(settings.api.bind)}")
    metrics = f"{settings.api.metrics_host}:{settings.api.metrics_port}" if settings.api.metrics_port else ""
    print(f"api_metrics={shlex.quote(metrics)}")
    # make run signs callbacks with a secret of its own, and admits a receiver on this machine, unless the
    # settings name their own (scripts/run-local).
    print(f"callback_secret_set={1 if settings.callbacks.secret else 0}")
    print(f"callback_key_secrets={shlex.quote(key_callback_secrets(settings.auth.api_keys))}")
    print(f"callback_allow_hosts={shlex.quote(' '.join(settings.callbacks.allow_hosts))}")
    # make run CELLS=N gives each cell a private Redis of its own: settings that name Sentinels or bulk shards
    # would point every cell's workers at the same ones, so it refuses them (scripts/run-local).
    print(f"redis_sentinels={shlex.quote(' '.join(settings.redis.sentinels))}")
    print(f"bulk_shards={shlex.quote(' '.join(settings.bulk.redis_urls))}")
    # Cells configured in the settings (a file's `cells:`; IMGSERVE_CELLS): make run CELLS=N makes its own.
    configured_cells = getattr(settings, "cells", ()) or ()
    print(f"configured_cells={len(configured_cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
