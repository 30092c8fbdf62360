"""Cells: the deployment as several control planes behind one API tier (docs/cells.md).

A cell is one control-plane Redis (with its replicas and Sentinels where configured, and its bulk shards) and the
CPU workers, GPU workers and Flower that serve it; those run exactly as a one-cell deployment's do, told their
cell's `redis_url`, `redis` and `bulk`. Only the API tier reads `cells`: it sends each new job to one of them and
reads a job where its id says it lives (contract.jobs.ids).

No `cells` (or `[]`): one cell made of the top-level `redis_url`, `redis` and `bulk`, today's deployment with every
setting keeping its meaning. With cells listed, the top-level `redis_url` is the API tier's own Redis (the rate
limits' and failed authentications' buckets), and the first cell is where ids made before cells live.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

from contract.settings.redis_settings import BulkSettings, RedisSettings
from contract.settings.sections import SettingsError, settings_class

# The cells from the environment, as YAML flow style: '[{name: a, redis_url: "redis://h:6390/0"}, ...]'.
CELLS_ENV = "IMGSERVE_CELLS"
CELL_NAME = re.compile(r"^[a-z0-9-]{1,16}$")
MAX_CELLS = 16  # a job id gives its cell one hex digit


@settings_class
class CellSettings:
    """One cell as the API tier sees it: its name, its control plane and bulk shards, its share of new jobs."""

    name: str
    redis_url: str
    redis: RedisSettings | None = None  # None: the top-level `redis` section's
    bulk: BulkSettings | None = None  # None: the top-level `bulk` section's
    gpu_capacity: float = 1.0  # the cell's GPUs against the others': the chooser's weight

    def __post_init__(self) -> None:
        if not CELL_NAME.match(self.name):
            raise SettingsError(f"cells: name {self.name!r} must be 1-16 of a-z, 0-9 and -")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(f"cells: cell {self.name!r}'s redis_url must be a redis:// URL")
        if not self.gpu_capacity > 0:
            raise SettingsError(f"cells: cell {self.name!r}'s gpu_capacity must be > 0")


def check_cells(cells: tuple[CellSettings, ...]) -> None:
    """Names unique, control planes distinct, at most MAX_CELLS."""
    if len(cells) > MAX_CELLS:
        raise SettingsError(f"cells: at most {MAX_CELLS} (a job id names its cell in one hex digit)")
    names = [cell.name for cell in cells]
    if len(set(names)) != len(names):
        raise SettingsError("cells: a name is listed twice")
    urls = [cell.redis_url for cell in cells]
    if len(set(urls)) != len(urls):
        raise SettingsError("cells: two cells share a redis_url (each cell is a control plane of its own)")


def cells_from_env(text: str) -> list[Any]:
    """IMGSERVE_CELLS' value as the list of cells it gives (checked as settings when they are built)."""
    try:
        cells = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(f"{CELLS_ENV}: not a YAML list: {exc}") from exc
    if not isinstance(cells, list):
        raise SettingsError(f"{CELLS_ENV}: a YAML list of cells, e.g. [{{name: a, redis_url: ...}}]")
    return cells


def cell_passwords(cells: tuple[CellSettings, ...]) -> Iterator[tuple[str, str]]:
    """(where, password) of every Redis password the cells' URLs carry: each is checked as a secret."""
    for cell in cells:
        shards = cell.bulk.redis_urls if cell.bulk else ()
        urls = [("redis_url", cell.redis_url), *(("bulk.redis_urls", url) for url in shards)]
        for where, url in urls:
            password = urlsplit(url).password
            if password:
                yield f"cell {cell.name}'s {where}", unquote(password)
