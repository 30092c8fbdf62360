"""The imgserve CLI where the stack is not needed: the API down, a reader that goes away, a cache hit's line."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from imgserve_client.cli import BROKEN_PIPE, UNREACHABLE, detections_table
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
        f"imgserve: cannot reach the API at {url} (connection refused); is it running? "
        "(`make run` starts it; --url or IMGSERVE_URL names another)"
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
