"""The deployment's cells as the API tier uses them (docs/cells.md): each cell's place, name and weight, and the
settings its own processes run with (the top-level ones with its Redis, Sentinels and shards). The `cells`
setting itself is contract.settings.cells'.
"""

from __future__ import annotations

import dataclasses

from contract.settings import Settings


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell: its place in the list (the digit its job ids carry), its name, its weight, and the settings its
    own processes would run with (the top-level ones with its Redis, Sentinels and shards)."""

    index: int
    name: str
    gpu_capacity: float
    settings: Settings


DEFAULT_CELL_NAME = "default"  # the one cell of a deployment without `cells`


def cells_of(settings: Settings) -> list[Cell]:
    """The deployment's cells, first to last; without `cells`, the one made of the top-level sections (the very
    settings given, so a one-cell deployment runs as it always has)."""
    if not settings.cells:
        return [Cell(0, DEFAULT_CELL_NAME, 1.0, settings)]
    return [
        Cell(
            index,
            cell.name,
            cell.gpu_capacity,
            dataclasses.replace(  # type: ignore[type-var]  # a pydantic dataclass
                settings,
                redis_url=cell.redis_url,
                redis=cell.redis or settings.redis,
                bulk=cell.bulk or settings.bulk,
                cells=(),
            ),
        )
        for index, cell in enumerate(settings.cells)
    ]
