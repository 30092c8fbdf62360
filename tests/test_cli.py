"""The imgserve CLI where the stack is not needed: the API down, a reader that goes away, a cache hit's line."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from imgserve_client.cli import BROKEN_PIPE, UNREACHABLE, api_url, detections_table
from tests.support import REPO_ROOT, free_port


def imgserve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "imgserve_client.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


@pytest.mark.parametrize(
    "command",
    [["models"], ["status", "0" * 32], ["status", "0" * 32, "--wait", "5"], ["submit", "samples/shapes-3.jpg"]]
    + [["submit", "samples/", "--wait"], ["cancel", "0" * 32]],
)
def test_the_api_down_is_one_line_and_a_non_zero_status(command):
    """Issue 53: `imgserve models` or `status` with the API down printed a 74-80-line requests traceback."""
    url = f"http://127.0.0.1:{free_port()}"
    result = imgserve("--url", url, *command)
    assert result.returncode == UNREACHABLE, result
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"imgserve: cannot reach the API at {url} (connection refused), given by --url; is it running? "
        "(`make run` starts one at http://localhost:8000; --url URL or IMGSERVE_URL=URL names another)"
    ]


def test_the_api_down_names_the_url_from_imgserve_url_and_how_to_change_it():
    """Issue 60.3: the CLI talked to localhost:8000 without saying so or how to point it elsewhere."""
    url = f"http://127.0.0.1:{free_port()}"
    result = imgserve("models", env={**os.environ, "IMGSERVE_URL": url})
    assert result.returncode == UNREACHABLE, result
    assert f"cannot reach the API at {url} (connection refused), from IMGSERVE_URL;" in result.stderr
    assert "--url URL or IMGSERVE_URL=URL names another" in result.stderr


def test_without_url_or_imgserve_url_the_default_is_named_as_the_default():
    """Where the URL came from, worked out without a request (nothing of ours may listen on :8000 here)."""
    assert api_url(None, {}) == ("http://localhost:8000", "the default (neither --url nor IMGSERVE_URL set)")
    assert api_url(None, {"IMGSERVE_URL": "http://api:9"}) == ("http://api:9", "from IMGSERVE_URL")
    assert api_url("http://a:1", {"IMGSERVE_URL": "http://api:9"}) == ("http://a:1", "given by --url")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An API that answers every request with a 4xx problem: 404 for a job, 401 for the rest."""

    def _problem(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, title = (404, "Job not found") if self.path.startswith("/v1/jobs/") else (401, "Unauthorized")
        body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": "no"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/problem+json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _problem  # noqa: N815 (http.server's names)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_api() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    "command,status",
    [
        (["status", "0" * 32], "404"),
        (["cancel", "0" * 32], "404"),
        (["models"], "401"),
        (["submit", "samples/shapes-3.jpg"], "401"),
    ],
)
def test_a_4xx_names_the_api_it_came_from_and_how_to_name_another(refusing_api, command, status):
    """Issue 60.3: a 404 from the wrong service (or the right one) said nothing of which API answered."""
    result = imgserve(*command, env={**os.environ, "IMGSERVE_URL": refusing_api})
    assert result.returncode == 1, result
    first, second = result.stderr.splitlines()
    assert first.startswith(f"error: {status} ")
    assert second == f"  (the API at {refusing_api}, from IMGSERVE_URL; --url URL or IMGSERVE_URL=URL names another)"


def test_submit_and_wait_refused_says_once_which_api_refused(refusing_api):
    result = imgserve("--url", refusing_api, "submit", "samples/shapes-3.jpg", "samples/shapes-36.jpg", "--wait")
    assert result.returncode == 1, result
    assert result.stdout.count("error ApiError 401") == 2
    assert result.stderr.splitlines() == [
        f"imgserve: 2 refused by the API at {refusing_api}, given by --url; --url URL or IMGSERVE_URL=URL names another"
    ]


class _Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"models": [{"name": f"model-{i}", "version": "1.0.0"} for i in range(2000)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api_with_many_models() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_reader_that_goes_away_ends_it_quietly(api_with_many_models):
    """`imgserve models | head` ended in a BrokenPipeError traceback."""
    process = subprocess.Popen(
        [sys.executable, "-m", "imgserve_client.cli", "--url", api_with_many_models, "models"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.read(10)  # head read its lines ...
    process.stdout.close()  # ... and went away, long before the 200 KB were written
    assert process.wait(60) == BROKEN_PIPE
    assert process.stderr.read() == b""


def test_a_cache_hit_says_so():
    doc = {
        "status": "succeeded",
        "cache": "hit",
        "result": {"image": {"width": 1280, "height": 720}, "detections": []},
        "timings_ms": {"total": 0.3},
    }
    assert detections_table(Path("a.jpg"), doc)[0] == "a.jpg: 0 detections in 1280x720 (cache hit, 0 ms)"
    doc["cache"] = "miss"
    assert detections_table(Path("a.jpg"), doc)[0] == "a.jpg: 0 detections in 1280x720 (0 ms)"


def test_a_servers_image_size_reaches_the_terminal_escaped():
    # `submit --wait` printed the result's width and height as the server sent them, so
    # a string there (escape sequences: a title, a cleared screen) reached the terminal raw.
    doc = {
        "status": "succeeded",
        "result": {"image": {"width": "640\x1b]0;owned\x07", "height": "480\x1b[2J"}, "detections": []},
        "timings_ms": {"total": 1.0},
    }
    line = detections_table(Path("a.jpg"), doc)[0]
    assert "\x1b" not in line and "\x07" not in line, line


def test_a_servers_scores_and_boxes_that_are_not_numbers_print_escaped_not_as_a_traceback():
    doc = {
        "status": "succeeded",
        "result": {
            "image": {"width": 640, "height": 480},
            "detections": [{"label": "cat", "score": "0.9\x1b[31m", "box": [1, "2\x07", 3.0, None]}],
        },
        "timings_ms": {"total": "\x1b[2J"},
    }
    lines = detections_table(Path("a.jpg"), doc)
    assert lines[0] == "a.jpg: 1 detections in 640x480 (\\x1b[2J ms)"
    assert lines[2] == "  cat          0.9\\x1b[31m  1, 2\\x07, 3, None"
