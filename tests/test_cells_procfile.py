"""tools.cells: the Procfile `make run CELLS=N` runs, each line run as tools.procfile runs it (`/bin/sh -c`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools.cells import LocalCell, cell_names, cells_procfile, main, read_cells_setting
from tools.procfile import parse_procfile

REPO_ROOT = Path(__file__).resolve().parents[1]
CELLS = [
    LocalCell("a", "redis://127.0.0.1:6390/0", 5555, 9100),
    LocalCell("b", "redis://127.0.0.1:6391/0", 5556, 9101),
]
# Each role prints what it would be started with: its Redis, its ports, and the cells it knows.
PROBES = {
    role: 'echo "$IMGSERVE_REDIS_URL ${FLOWER_PORT:-none} ${GPU_METRICS_PORT:-none} ${IMGSERVE_CELLS:-none}"'
    for role in ("api", "cpu-worker", "callback-worker", "gpu-worker", "flower")
}


def run_line(command: str) -> str:
    environ = {"PATH": "/usr/bin:/bin", "IMGSERVE_CELLS": "inherited", "IMGSERVE_REDIS_URL": "redis://elsewhere"}
    return subprocess.run(["/bin/sh", "-c", command], env=environ, capture_output=True, text=True, check=True).stdout


def test_every_worker_runs_once_per_cell_on_its_cells_redis_alone():
    rendered = cells_procfile(PROBES, CELLS)
    assert sorted(rendered) == sorted(
        ["api"] + [f"{role}-{cell}" for role in PROBES if role != "api" for cell in ("a", "b")]
    )
    for name, command in rendered.items():
        if name == "api":
            continue
        cell = CELLS[0] if name.endswith("-a") else CELLS[1]
        # IMGSERVE_CELLS from the caller's environment does not reach a cell's workers: they know one cell.
        assert run_line(command).split() == [cell.redis_url, str(cell.flower_port), str(cell.gpu_metrics_port), "none"]


def test_the_api_knows_every_cell_and_uses_the_first_cells_redis_as_its_own():
    url, _flower, _metrics, *cells_words = run_line(cells_procfile(PROBES, CELLS)["api"]).split()
    assert url == "redis://127.0.0.1:6390/0"
    assert read_cells_setting(" ".join(cells_words)) == [
        {"name": "a", "redis_url": "redis://127.0.0.1:6390/0"},
        {"name": "b", "redis_url": "redis://127.0.0.1:6391/0"},
    ]


def test_a_cell_behind_sentinels_has_its_processes_and_the_api_follow_them():
    cells = [LocalCell.parse("a=redis://127.0.0.1:6390/0=5555=9100=127.0.0.1:26379,127.0.0.1:26380"), CELLS[1]]
    probes = {"api": 'echo "$IMGSERVE_REDIS__SENTINELS|$IMGSERVE_CELLS"', "gpu-worker": PROBES["gpu-worker"]}
    probes["gpu-worker"] += ' "${IMGSERVE_REDIS__SENTINELS:-none}" "${IMGSERVE_REDIS__SERVICE:-none}"'
    rendered = cells_procfile(probes, cells)
    assert run_line(rendered["gpu-worker-a"]).split()[-3:] == ["[127.0.0.1:26379,", "127.0.0.1:26380]", "imgserve"]
    assert run_line(rendered["gpu-worker-b"]).split()[-2:] == ["none", "none"]  # cell b: its Redis as it is
    sentinels, cells_text = run_line(rendered["api"]).strip().split("|")
    assert sentinels == "[127.0.0.1:26379, 127.0.0.1:26380]"  # the tier's own Redis: the first cell's
    entries = read_cells_setting(cells_text)
    assert entries[0]["redis"] == {"sentinels": ["127.0.0.1:26379", "127.0.0.1:26380"], "service": "imgserve"}
    assert "redis" not in entries[1]


def test_the_repository_procfile_renders_and_parses_back(tmp_path, capsys):
    procfile = tmp_path / "Procfile"
    procfile.write_text((REPO_ROOT / "Procfile").read_text())
    assert main(["procfile", str(procfile), "--cell", "a=redis://127.0.0.1:6390/0=5555=9100"]) == 0
    parsed = parse_procfile(capsys.readouterr().out)
    assert set(parsed) == {"api", "cpu-worker-a", "callback-worker-a", "gpu-worker-a", "flower-a"}
    assert parsed["gpu-worker-a"].endswith(parse_procfile(procfile.read_text())["gpu-worker"])


def test_cell_names_and_their_limits():
    assert cell_names(3) == ["a", "b", "c"]
    for count in (0, 9):
        with pytest.raises(ValueError, match="from 1 to 8"):
            cell_names(count)
    assert cell_names(26, most=26)[-1] == "z"
    assert main(["names", "9"]) == 2
    with pytest.raises(ValueError, match="cell name"):
        LocalCell.parse("Big=redis://127.0.0.1:1/0=1=2")
