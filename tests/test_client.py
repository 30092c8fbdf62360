"""The Python client and the imgserve CLI against the running stack."""
from __future__ import annotations

import subprocess
import sys

import pytest

from imgserve_client import ApiError, Client
from tests.support import REPO_ROOT, encode, jpeg, make_image

pytestmark = pytest.mark.integration


def test_client_submits_waits_reads_and_cancels(stack):
    client = Client(stack.api.url)
    doc = client.submit(jpeg(400, 300), wait=True, conf=0.5)
    assert doc["status"] == "succeeded" and doc["options"] == {"conf": 0.5}
    assert doc["result"]["image"] == {"width": 400, "height": 300}
    assert client.status(doc["id"])["id"] == doc["id"]
    with pytest.raises(ApiError) as caught:
        client.cancel(doc["id"])
    assert caught.value.status == 409
    assert [m["name"] for m in client.models()] == ["content-box"]


def test_client_submits_many_files_with_bounded_concurrency(stack, tmp_path):
    paths = []
    for i in range(5):
        path = tmp_path / f"img{i}.png"
        path.write_bytes(encode(make_image(100 + i, 80), "PNG"))
        paths.append(path)
    results = list(Client(stack.api.url).submit_many(paths, concurrency=2))
    assert [p for p, _ in results] == paths
    assert [d["result"]["image"]["width"] for _, d in results] == [100, 101, 102, 103, 104]


def test_cli_submits_a_folder_and_prints_the_detections(stack, tmp_path):
    for i in range(3):
        (tmp_path / f"photo{i}.jpg").write_bytes(jpeg(320 + i, 240, seed=i))
    (tmp_path / "notes.txt").write_text("not an image")
    result = subprocess.run([sys.executable, "-m", "imgserve_client.cli", "--url", stack.api.url, "submit",
                             str(tmp_path), "--wait"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("1 detections in") == 3
    assert "content" in result.stdout and "notes.txt" not in result.stdout


def test_cli_reports_api_errors_plainly(stack):
    result = subprocess.run([sys.executable, "-m", "imgserve_client.cli", "--url", stack.api.url, "status", "nope"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "404" in result.stderr


def test_the_clients_terminal_states_are_the_services():
    """The client imports nothing from the service; this keeps its copy honest."""
    from contract.jobs import TERMINAL
    from imgserve_client import TERMINAL as client_terminal

    assert set(client_terminal) == {status.value for status in TERMINAL}
