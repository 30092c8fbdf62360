"""The cells `make run CELLS=N` runs on this machine: their names, ports and the Procfile that runs them.

    python -m tools.cells names N
    python -m tools.cells start-sentinels --dir var/redis-ha-cell-a
    python -m tools.cells procfile Procfile --cell NAME=REDIS_URL=FLOWER_PORT=GPU_METRICS_PORT[=SENTINELS] ...

A cell is one control-plane Redis with the CPU, callback and GPU workers and the Flower that serve it; the API
tier (one API) knows every cell through IMGSERVE_CELLS (docs/running-cells.md). `procfile` writes the Procfile
tools.procfile runs: each worker line once per cell, named `<role>-<cell>`, with IMGSERVE_REDIS_URL,
FLOWER_PORT and GPU_METRICS_PORT set to its cell's and IMGSERVE_CELLS unset (a cell's workers know nothing of the
others), and the API once, with IMGSERVE_CELLS naming every cell and the first cell's Redis as the tier's own.
`names` prints the first N cell names (a, b, c ...), one a line. `start-sentinels` starts one cell's primary, two
replicas and three Sentinels (make run CELLS=N REDIS=sentinel: tools.redis_ha, a set a cell) and prints where they
are; with SENTINELS given, a cell's processes follow its primary through them (IMGSERVE_REDIS__SENTINELS) and the
API's IMGSERVE_CELLS gives the cell's `redis` section.
"""

from __future__ import annotations

import argparse
import re
import shlex
import string
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tools.procfile import parse_procfile

CELLS_ENV = "IMGSERVE_CELLS"
MAX_LOCAL_CELLS = 8  # one machine: past this, each cell's workers only fight for its cores
API_ROLE = "api"
CELL_NAME = re.compile(r"^[a-z0-9-]{1,16}$")
SENTINEL_SERVICE = "imgserve"  # tools.redis_ha's


@dataclass(frozen=True)
class LocalCell:
    """One cell as make run runs it: its name, its Redis (or the Sentinels that name its primary) and the ports its
    Flower and GPU worker bind."""

    name: str
    redis_url: str
    flower_port: int
    gpu_metrics_port: int
    sentinels: tuple[str, ...] = ()  # "host:port" of each; none: redis_url's server, as it is

    @classmethod
    def parse(cls, argument: str) -> LocalCell:
        """NAME=REDIS_URL=FLOWER_PORT=GPU_METRICS_PORT[=SENTINEL,SENTINEL,...] (a Redis URL holds no `=`)."""
        name, redis_url, flower_port, metrics_port, *sentinels = argument.split("=")
        if not CELL_NAME.match(name):
            raise ValueError(f"cell name {name!r}: expected 1-16 of a-z, 0-9 and -")
        listed = tuple(filter(None, sentinels[0].split(","))) if sentinels else ()
        return cls(name, redis_url, int(flower_port), int(metrics_port), listed)

    def redis_env(self) -> dict[str, str]:
        """The variables that point a process at this cell's control plane (contract.settings.config's names)."""
        variables = {"IMGSERVE_REDIS_URL": self.redis_url}
        if self.sentinels:
            variables["IMGSERVE_REDIS__SENTINELS"] = "[" + ", ".join(self.sentinels) + "]"
            variables["IMGSERVE_REDIS__SERVICE"] = SENTINEL_SERVICE
        return variables


def cell_names(count: int, most: int = MAX_LOCAL_CELLS) -> list[str]:
    """The first `count` cells' names: a, b, c ... (at most `most`, 26 at the most: make run's limit by default)."""
    if not 1 <= count <= min(most, len(string.ascii_lowercase)):
        raise ValueError(f"{count} cells: from 1 to {most}")
    return list(string.ascii_lowercase[:count])


def cells_setting(cells: list[LocalCell]) -> str:
    """IMGSERVE_CELLS's value: the cells as the settings' `cells` list, in YAML flow style."""
    entries: list[dict[str, object]] = []
    for cell in cells:
        entry: dict[str, object] = {"name": cell.name, "redis_url": cell.redis_url}
        if cell.sentinels:
            entry["redis"] = {"sentinels": list(cell.sentinels), "service": SENTINEL_SERVICE}
        entries.append(entry)
    return yaml.safe_dump(entries, default_flow_style=True, width=10_000).strip()


def read_cells_setting(text: str) -> list[dict[str, object]]:
    """IMGSERVE_CELLS read back as the API tier reads it (YAML flow style): a list of {name, redis_url, ...}."""
    value = yaml.safe_load(text)
    if not isinstance(value, list) or not all(isinstance(entry, dict) and "name" in entry for entry in value):
        raise ValueError(f"{CELLS_ENV}: expected a list of {{name: ..., redis_url: ...}}, got {text!r}")
    return value


def _exports(variables: dict[str, str]) -> str:
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in variables.items()) + "; "


def cells_procfile(processes: dict[str, str], cells: list[LocalCell]) -> dict[str, str]:
    """The Procfile's processes for these cells: the API once, knowing every cell (the first's Redis is the API
    tier's own: keys, rate limits); every other process once per cell, pointed at its cell's Redis alone. The
    variables are exported before the command, not prefixed to it: the commands read them (${FLOWER_PORT})."""
    if not cells:
        raise ValueError("no cells")
    rendered: dict[str, str] = {}
    for role, command in processes.items():
        if role == API_ROLE:
            api_env = {**cells[0].redis_env(), CELLS_ENV: cells_setting(cells)}
            rendered[role] = _exports(api_env) + command
            continue
        for cell in cells:
            cell_env = {
                **cell.redis_env(),
                "FLOWER_PORT": str(cell.flower_port),
                "GPU_METRICS_PORT": str(cell.gpu_metrics_port),
            }
            rendered[f"{role}-{cell.name}"] = f"unset {CELLS_ENV}; " + _exports(cell_env) + command
    return rendered


def start_sentinels(folder: Path) -> str:
    """Start one cell's Redis set (emptied first, as make run REDIS=sentinel's) and say, as shell assignments,
    `cell_sentinels` (comma-separated) and `cell_primary_port` (where the primary is now: the cell's redis_url,
    whose host and port the Sentinels override, is unique per cell with it)."""
    from tools.redis_ha import RedisHA

    ha = RedisHA(folder.resolve()).start()
    primary = ha.primary()
    if primary is None:
        raise ValueError(f"the Sentinels in {folder} name no primary")
    return f"cell_sentinels={shlex.quote(','.join(ha.sentinels))}\ncell_primary_port={ha.nodes[primary].port}"


def render(processes: dict[str, str]) -> str:
    return "".join(f"{name}: {command}\n" for name, command in processes.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cells", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    names = commands.add_parser("names", help="the first N cells' names, one a line")
    names.add_argument("count", type=int)
    sentinels = commands.add_parser(
        "start-sentinels", help="a primary, two replicas and three Sentinels for one cell (tools.redis_ha)"
    )
    sentinels.add_argument("--dir", type=Path, required=True)
    procfile = commands.add_parser("procfile", help="the Procfile that runs these cells")
    procfile.add_argument("procfile", type=Path)
    procfile.add_argument("--cell", action="append", required=True, metavar="NAME=REDIS_URL=FLOWER=METRICS")
    args = parser.parse_args(argv)
    try:
        if args.command == "names":
            if not 1 <= args.count <= MAX_LOCAL_CELLS:
                raise ValueError(f"CELLS={args.count}: make run runs 1 to {MAX_LOCAL_CELLS} cells on one machine")
            print("\n".join(cell_names(args.count)))
        elif args.command == "start-sentinels":
            print(start_sentinels(args.dir))
        else:
            cells = [LocalCell.parse(argument) for argument in args.cell]
            print(render(cells_procfile(parse_procfile(args.procfile.read_text()), cells)), end="")
    except ValueError as exc:
        print(f"tools.cells: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
