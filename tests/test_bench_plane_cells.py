"""bench plane --cells: its arithmetic (the deployment's ceiling at the split measured, the verdict of the targets)
and a short real run over two cells behind one API, each with its own Redis and workers."""

import pytest

from bench.meters.plane import PHASES
from bench.meters.plane_cells import run_cells
from bench.meters.plane_cells_report import ceiling, report, verdict
from bench.meters.plane_meter import PhaseCost


def _side(*cells: tuple[int, float, float]) -> dict:
    per_cell = [
        {"images": images, "total": PhaseCost(us=us, commands=commands), "phases": {}} for images, us, commands in cells
    ]
    return {"cells": len(cells), "images": sum(c[0] for c in cells), "per_cell": per_cell, "ended": {}}


def test_the_ceiling_is_where_the_busiest_cell_reaches_70_percent_at_the_split_measured():
    one = _side((1000, 400.0, 36.0))
    assert ceiling(one) == pytest.approx(0.7e6 / 400.0)
    # cell a took 60% of the images at 400 µs each: it reaches 70% first, at 1,750 / 0.6 images/s in all
    uneven = _side((600, 400.0, 36.0), (400, 400.0, 36.0))
    assert ceiling(uneven) == pytest.approx(0.7e6 / 400.0 / 0.6)
    even = _side((500, 400.0, 36.0), (500, 420.0, 36.5))
    found = verdict(one, even)
    assert found["ceiling_ratio"] == pytest.approx((0.7e6 / 420.0 / 0.5) / (0.7e6 / 400.0))
    assert found["met"] and found["cost"] == "us"
    assert not verdict(one, uneven)["met"]  # 20% off an even share
    assert not verdict(one, _side((500, 460.0, 36.0), (500, 400.0, 36.0)))["met"]  # a cell 1.15x one cell's µs


@pytest.mark.integration
def test_two_cells_behind_one_api_split_the_images_and_each_prices_its_own(tmp_path):
    one = run_cells(1, images=16, shards=1, clients=4, workdir=tmp_path / "one")
    many = run_cells(2, images=16, shards=1, clients=4, workdir=tmp_path / "many")
    assert one["ended"] == {"succeeded": 16} and many["ended"] == {"succeeded": 32}
    assert sum(cell["images"] for cell in many["per_cell"]) == 32
    for cell in many["per_cell"]:
        assert cell["images"] > 0, "the chooser placed jobs in both cells"
        for phase in PHASES:
            assert cell["phases"][phase].commands > 0, phase
    for cell in [*one["per_cell"], *many["per_cell"]]:  # what each cell's main thread did, read per image
        thread = cell["main_thread"]
        assert thread["user_us"] > 0 and thread["in_commands_us"] > 0 and thread["voluntary"] > 0, thread
    text = report(one, many)
    assert "| 2 cells: b |" in text and "one cell's" in text
    assert "| cell | user µs | system µs |" in text and "FCALL" in text.upper()


def test_a_pinned_cell_holds_its_redis_main_thread_to_its_core(tmp_path):
    import os

    from bench.meters.plane_cells import PlaneCell

    core = max(os.sched_getaffinity(0))
    cell = PlaneCell.start(tmp_path / "cell", shards=0, room=8, core=core)
    try:
        assert os.sched_getaffinity(cell.server.process.pid) == {core}
    finally:
        cell.stop()
