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
    result = subprocess.run(
        [sys.executable, "-m", "imgserve_client.cli", "--url", stack.api.url, "submit", str(tmp_path), "--wait"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("1 detections in") == 3
    assert "content" in result.stdout and "notes.txt" not in result.stdout


def test_cli_reports_api_errors_plainly(stack):
    result = subprocess.run(
        [sys.executable, "-m", "imgserve_client.cli", "--url", stack.api.url, "status", "nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "404" in result.stderr


def test_the_clients_terminal_states_are_the_services():
    """The client imports nothing from the service; this keeps its copy honest."""
    from contract.jobs.record import TERMINAL
    from imgserve_client import TERMINAL as client_terminal

    assert set(client_terminal) == {status.value for status in TERMINAL}


def test_submit_with_wait_is_one_call_when_the_job_ends_in_time(stack):
    client = Client(stack.api.url)
    calls: list[str] = []
    client.session.hooks["response"].append(lambda response, *_, **__: calls.append(response.request.method))
    doc = client.submit(jpeg(320, 240, seed=7), wait=True)
    assert doc["status"] == "succeeded" and calls == ["POST"]


def test_cli_draws_the_boxes_on_the_image(stack, tmp_path):
    from PIL import Image

    from imgserve_client.draw import COLOURS

    source = tmp_path / "in.jpg"
    source.write_bytes(jpeg(400, 300, seed=8))
    out = tmp_path / "drawn.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "imgserve_client.cli",
            "--url",
            stack.api.url,
            "submit",
            str(source),
            "--draw",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"drawn: {out}" in result.stdout
    drawn = Image.open(out).convert("RGB")
    assert drawn.size == (400, 300)
    # The test model's one box is the whole image: its outline runs along the edges, in class 0's colour.
    assert drawn.getpixel((200, 299)) == COLOURS[0] and drawn.getpixel((0, 150)) == COLOURS[0]
    folder = tmp_path / "boxes"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "imgserve_client.cli",
            "--url",
            stack.api.url,
            "submit",
            str(source),
            str(source),
            "--draw",
            str(folder),
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert [p.name for p in folder.iterdir()] == ["in.jpg"]


def test_submit_with_wait_falls_back_to_two_calls_where_the_deployment_waits_less(stack):
    """A deployment whose api.max_wait_s is under the client's one-call wait refuses that `wait` (400, before
    the body is read, so no job is made): the client submits again with a shorter one, and remembers. (Its
    long-poll asked for 25 s whatever the deployment took, and failed there.)"""
    import dataclasses

    from app import create_app
    from tests.support import ApiServer

    settings = dataclasses.replace(stack.settings, api=dataclasses.replace(stack.settings.api, max_wait_s=5))
    server = ApiServer(create_app(settings))
    try:
        client = Client(server.url)
        calls: list[tuple[str, int]] = []
        client.session.hooks["response"].append(
            lambda response, *_, **__: calls.append((response.request.method, response.status_code))
        )
        doc = client.submit(jpeg(300, 200, seed=9), wait=True)
        assert doc["status"] == "succeeded"
        assert calls[0] == ("POST", 400) and calls[1][0] == "POST" and calls[1][1] in (200, 202)
        assert {method for method, _ in calls[2:]} <= {"GET"}
        calls.clear()
        assert client.status(doc["id"], wait_s=20)["status"] == "succeeded" and calls == [("GET", 200)]  # learnt
    finally:
        server.stop()
