"""`bench instructions`: the CPU work of one unit counted in instructions by valgrind's callgrind, the same
figure run after run whatever else this shared machine does.

    python -m bench instructions --role api,cpu-task
    python -m bench instructions --role api --base HEAD~1      # two builds, side by side
    python -m bench instructions --role api --cells 2          # the API in front of one cell, then two

CPU seconds per image move by a third from one minute to the next here, more than most single changes to the
stack's overhead; an instruction count does not move. It counts user-space instructions only: not the kernel's
work (a socket's send and receive), not cache misses, not Redis. So it decides between two versions of Python
code; `bench ab` remains the figure users see.

- api: one gevent API worker under gunicorn (the project's gunicorn config, one worker), per submit of a
  0.4-1 MB JPEG (raw body) and a poll of its job, each job ended by the bench as the GPU worker's batch write
  would end it (JobEnding.finish) before the poll is sent: the poll never waits. Whether a poll waited depends
  on timing, and the count would move with it; a wait adds a registration, a wake-up and a second read of
  the job, which this figure leaves out. Counted: gunicorn, gevent, Flask, the app, redis-py, in that worker
  (its pub/sub listener hears every job's end either way).
  With `--cells N` the same API worker counted twice in one run, in front of one cell and then of N cells
  (docs/cells.md: the chooser places every job, each cell its own Redis), so the API tier's cost of cells shows.
- cpu-task: one CPU worker child's task (Preprocessor.run: claim, read the upload, decode, letterbox, pack,
  push), and decode + letterbox alone on the same images: the difference is the task's plumbing. Celery's
  own work per task (its main process's receive, hand-off and ack) is not in it.

Each figure is the difference between a run of N1 units and one of N2, over N2 - N1: start-up and imports
cancel out. A run of the API takes minutes (valgrind runs Python some 50 times slower).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.stack.processes import RedisServer

ROLES = ("api", "cpu-task")
CELL_NAMES = "abcdefghijklmnop"  # as contract.settings.cells allows: one hex digit of a job id
PACKAGES = ("app", "contract", "tasks", "gpu_worker")  # the measured checkout's code
CHILD = Path(__file__).with_name("instructions_child.py")  # run by path: it imports the measured checkout's code


@dataclass(frozen=True)
class Counted:
    role: str
    unit: str
    per_unit: float  # instructions
    reference: float | None = None  # cpu-task: decode + letterbox alone, per image
    idle_per_s: float | None = None  # api, marked: the worker's instructions a second with nothing to do

    @property
    def over_reference(self) -> float | None:
        return self.per_unit - self.reference if self.reference is not None else None


def callgrind_total(text: str) -> int:
    """The instructions a callgrind output file counts (its `totals:` or `summary:` line)."""
    for line in text.splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError("no totals in this callgrind output")


def per_unit(first: int, second: int, first_units: int, second_units: int) -> float:
    """Instructions per unit from two runs of different lengths (what both runs share cancels out)."""
    if second_units <= first_units:
        raise ValueError("the second run must hold more units than the first")
    return (second - first) / (second_units - first_units)


def run_counted(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    work: Path,
    drive: Callable[[subprocess.Popen, Path], None] = lambda process, out: None,
) -> int:
    """Run `argv` (and its children) under callgrind; `drive` does the work meanwhile and stops it (given the
    folder of callgrind's files, `cg.PID`). The largest count of its processes: the one that did the work (a
    gunicorn worker, not its master)."""
    out = Path(tempfile.mkdtemp(prefix="callgrind-", dir=work))
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--trace-children=yes", f"--callgrind-out-file={out}/cg.%p", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(out / "stderr", "w"),
        start_new_session=True,
    )
    try:
        drive(process, out)
        process.wait(timeout=1800)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    counts = [callgrind_total(path.read_text()) for path in out.glob("cg.*")]
    if process.returncode or not counts:
        raise RuntimeError(f"{argv[0]} under valgrind failed: {(out / 'stderr').read_text()[-2000:]}")
    return max(counts)


def count_cpu_task(root: Path, images: list[bytes], tasks: tuple[int, int] = (10, 60)) -> Counted:
    work = Path(tempfile.mkdtemp(prefix="instructions-task-"))
    for index, image in enumerate(images[:4]):
        (work / f"image-{index}.jpg").write_bytes(image)

    def run(mode: str, count: int) -> int:
        server = RedisServer(work)
        try:
            if mode == "task":
                _store_jobs(root, server.url, work, count)
            argv = [sys.executable, str(CHILD), str(root), server.url, str(work), mode, str(count)]
            return run_counted(argv, root, dict(os.environ), work)
        finally:
            server.stop()

    task = per_unit(run("task", tasks[0]), run("task", tasks[1]), *tasks)
    decode = per_unit(run("decode", tasks[0]), run("decode", tasks[1]), *tasks)
    return Counted("cpu-task", "task", task, reference=decode)


def _store_jobs(root: Path, redis_url: str, work: Path, count: int) -> None:
    """The jobs the child's tasks take, stored as the API stores them, outside the count."""
    subprocess.run(
        [sys.executable, str(CHILD), str(root), redis_url, str(work), "store", str(count)], cwd=root, check=True
    )


def markdown(counted: dict[str, list[Counted]]) -> str:
    """One table: a row per role and side."""
    lines = [
        "## bench instructions: user-space instructions per unit (valgrind callgrind)",
        "",
        "| side | role | unit | instructions | decode + letterbox alone | over it | idle, a second |",
        "|---|---|---|---|---|---|---|",
    ]
    for side, rows in counted.items():
        for row in rows:
            reference = f"{row.reference / 1e6:.2f} M" if row.reference is not None else "-"
            over = f"{row.over_reference / 1e6:.2f} M" if row.over_reference is not None else "-"
            idle = f"{row.idle_per_s / 1e6:.2f} M" if row.idle_per_s is not None else "-"
            lines.append(
                f"| {side} | {row.role} | {row.unit} | {row.per_unit / 1e6:.2f} M | {reference} | {over} | {idle} |"
            )
    return "\n".join(lines)
