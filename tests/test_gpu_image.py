"""scripts/gpu-smoke runs on the GPU machine's own image, which lacks the API's and the CPU workers' packages.

A GPU is lent to few sessions; an import the image cannot satisfy would spend one on tracebacks. These run
the smoke's import check here, in a fresh interpreter, with what the image lacks made unimportable.
"""

from __future__ import annotations

import subprocess
import sys

from bench.stack.processes import REPO_ROOT
from tools import gpu_image


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.gpu_image", "check", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_gpu_checks_import_without_the_packages_the_image_lacks():
    result = run_check("--block-absent")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"imports: all {len(gpu_image.NEEDED)} modules import"


def test_the_block_bites_a_module_that_needs_flask_or_celery():
    result = run_check("--block-absent", "app", "tasks.hop.celery_app")
    assert result.returncode == 1
    assert "app: ModuleNotFoundError" in result.stdout and "tasks.hop.celery_app: ModuleNotFoundError" in result.stdout
    assert "not on the GPU machine's image" in result.stdout


def test_what_is_carried_is_pinned_at_this_environments_versions():
    pins = gpu_image.pins()
    assert [pin.split("==")[0] for pin in pins] == list(gpu_image.CARRIED)
    assert all(pin.split("==")[1][0].isdigit() for pin in pins)
    assert not set(gpu_image.CARRIED) & set(gpu_image.ABSENT)
