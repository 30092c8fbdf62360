"""configs/redis.conf, the control plane's Redis settings beyond Redis's defaults, as redis-server's command-line
options (`--name value`). Never handed to redis-server as its config file: CONFIG REWRITE (Sentinel runs it on every
server it reconfigures) would write the server's whole state into the checkout's file."""

from __future__ import annotations

from pathlib import Path

REDIS_CONFIG = Path("configs") / "redis.conf"


def redis_config_args(root: Path) -> list[str]:
    """The settings of `root`'s configs/redis.conf as options; none when that checkout has no such file."""
    path = root / REDIS_CONFIG
    if not path.exists():
        return []
    args: list[str] = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, value = line.split(None, 1)
            args += [f"--{name}", value.strip()]
    return args
