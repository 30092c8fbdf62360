"""What `make run` (scripts/run-local) needs of the settings, as shell assignments: `eval "$(python -m
tools.run_settings)"` sets `redis_url` and `api_url`. Read by contract.config as every process reads them,
so a settings file or variable that does not load stops `make run` before anything starts."""

from __future__ import annotations

import shlex
import sys

from contract.config import load_settings


def api_url(bind: str) -> str:
    """Where a client on this machine reaches gunicorn's `bind`: a wildcard address is reached at loopback."""
    if bind.startswith(("unix:", "fd://")):
        return bind  # not reached over TCP: no URL to print or poll
    host, _, port = bind.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"


def main() -> int:
    settings = load_settings()
    print(f"redis_url={shlex.quote(settings.redis_url)}")
    print(f"api_url={shlex.quote(api_url(settings.api.bind))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
