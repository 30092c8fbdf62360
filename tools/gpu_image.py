"""What `scripts/gpu-smoke` needs on the GPU machine that its image does not have.

    python -m tools.gpu_image pins                   the carried distributions at this venv's versions
    python -m tools.gpu_image check [--block-absent] import every module the GPU checks need

The device tool's GPU machine runs the project under its own image's python3 and packages (torch 2.11 with
CUDA, numpy, Pillow, PyYAML, pytest, hypothesis, requests, tqdm, prometheus-client, ...: the device README's
KINDS.md); the project's pins do not apply there, and nothing can be installed from an index. Of what the GPU
checks import, the image lacks `CARRIED`, which `scripts/gpu-smoke --prepare` brings as wheels, and `ABSENT`,
which the checks must therefore never import: the API's and the CPU workers' own packages. `check
--block-absent` makes `ABSENT` unimportable first, so this machine's suite (which has them all) catches a GPU
check that starts needing one, rather than the rare session that is lent a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from importlib.metadata import version

CARRIED = ("pydantic", "redis", "hiredis")
"""Distributions the GPU checks need and the image lacks; pydantic's own needs come with it."""

ABSENT = ("flask", "celery", "kombu", "billiard", "gunicorn", "gevent", "flower", "schemathesis")
"""Top-level modules the image lacks and nobody carries (werkzeug, click and requests are there)."""

NEEDED = CARRIED + (
    "contract.settings",
    "contract.documents",
    "contract.workers.heartbeat",
    "gpu_worker.worker",
    "gpu_worker.model",
    "gpu_worker.metrics",
    "gpu_worker.__main__",
    "bench.meters.feed",
    "bench.load.runs",
    "bench.stack.processes",
    "tests.conftest",
    "tests.support",
    "tests.test_gpu",
    "training.export_program",
)
"""What `pytest -m gpu`, `bench feed` (and the `python -m gpu_worker` it starts) and the export import (the
carried distributions' modules have their names)."""


def pins() -> list[str]:
    return [f"{name}=={version(name)}" for name in CARRIED]


def _is_absent(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in ABSENT)


class _RefuseAbsent(importlib.abc.MetaPathFinder):
    """Makes `ABSENT` (and its submodules) fail to import, as on the image."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec:
        if _is_absent(fullname):
            raise ModuleNotFoundError(f"No module named {fullname!r} (not on the GPU machine's image)", name=fullname)
        return None  # type: ignore[return-value]  # not ours: the next finder looks


def check(modules: Sequence[str] = NEEDED, *, block_absent: bool = False) -> list[str]:
    """Imports each module; returns one line per module that failed, naming why."""
    if block_absent:
        already = sorted(filter(_is_absent, sys.modules))
        if already:
            raise RuntimeError(f"already imported, cannot be blocked: {already}")
        sys.meta_path.insert(0, _RefuseAbsent())
    failures = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure to import is what this reports
            failures.append(f"{name}: {type(error).__name__}: {error}")
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_image", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pins", help="the carried distributions, NAME==VERSION, one a line (a requirements file)")
    checking = commands.add_parser("check", help="import every module the GPU checks need")
    checking.add_argument("--block-absent", action="store_true", help="as on the image: ABSENT cannot be imported")
    checking.add_argument("modules", nargs="*", default=list(NEEDED), help="instead of the GPU checks' modules")
    options = parser.parse_args(argv)
    if options.command == "pins":
        print("\n".join(pins()))
        return 0
    failures = check(options.modules, block_absent=options.block_absent)
    if failures:
        print("imports: FAILED " + "; ".join(failures))
    else:
        print(f"imports: all {len(options.modules)} modules import")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
