"""Hostile clients against the API as users run it (gunicorn, configs/gunicorn.conf.py): slow
headers, bodies over the limit or shorter than promised, broken framing, doubled fields, ids
that are not ids. Each gets a clear answer or a closed connection; nobody else waits."""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from bench.stack.processes import children_of, status_kb
from tests.conftest import STACK_MAX_UPLOAD
from tests.support import jpeg, wait_until

pytestmark = pytest.mark.integration
SLOW_CLIENTS = 300


def raw_exchange(
    port: int, request: bytes, half_close: bool = False, timeout_s: float = 30.0
) -> tuple[int, dict, bytes]:
    """Send bytes as they are; the status, headers and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def problem(status: int, headers: dict, body: bytes) -> dict:
    assert headers["content-type"] == "application/problem+json", (status, headers, body[:200])
    document = json.loads(body)
    assert document["status"] == status
    return document


def test_slow_clients_leave_health_and_submissions_answering_and_are_dropped(gunicorn_api):
    slow = []
    for _ in range(SLOW_CLIENTS):
        sock = socket.create_connection(("127.0.0.1", gunicorn_api.port), timeout=30)
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nX-Slow: ")  # never ends
        slow.append(sock)
    try:
        started = time.monotonic()
        assert requests.get(gunicorn_api.url + "/healthz", timeout=1).status_code == 200
        submitted = requests.post(
            gunicorn_api.url + "/v1/jobs", data=jpeg(64, 64), timeout=1, headers={"Content-Type": "image/jpeg"}
        )
        assert submitted.status_code == 202 and time.monotonic() - started < 2
        # Headers must arrive within the keep-alive bound (5 s): then the connection is closed.
        assert all(
            wait_until(lambda s=sock: s.recv(1) == b"", 30, what="a slow client to be dropped") is True
            for sock in slow[:5]
        )
    finally:
        for sock in slow:
            sock.close()


def test_a_chunked_body_over_the_limit_is_413_not_cut_short(gunicorn_api):
    chunk = b"\xff" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(STACK_MAX_UPLOAD // len(chunk) + 2))
    status, headers, answer = raw_exchange(
        gunicorn_api.port,
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n",
    )
    assert status == 413 and problem(status, headers, answer)["type"] == "/problems/request-entity-too-large"


def test_a_chunked_body_within_the_limit_is_accepted_whole(gunicorn_api):
    image = jpeg(320, 240)
    body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (image[:1000], image[1000:]))
    status, _, answer = raw_exchange(
        gunicorn_api.port,
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n",
    )
    assert status == 202, answer
    job = requests.get(gunicorn_api.url + f"/v1/jobs/{json.loads(answer)['id']}", params={"wait": 20}, timeout=30)
    assert job.json()["status"] == "succeeded" and job.json()["result"]["image"] == {"width": 320, "height": 240}


def test_a_body_shorter_than_its_content_length_is_400(gunicorn_api):
    image = jpeg(320, 240)
    status, headers, answer = raw_exchange(
        gunicorn_api.port,
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(image) + image[: len(image) // 2],
        half_close=True,
    )
    assert status == 400 and problem(status, headers, answer)["type"] == "/problems/truncated-body"


@pytest.mark.parametrize("framing", [b"zz\r\nabc\r\n0\r\n\r\n", b"5\r\nab\r\n0\r\n\r\n", b"3\r\nabcXX0\r\n\r\n"])
def test_broken_chunked_framing_is_a_400_problem_not_a_500(gunicorn_api, framing):
    status, headers, answer = raw_exchange(
        gunicorn_api.port,
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n" + framing,
        half_close=True,
    )
    assert status == 400, answer
    if headers.get("content-type") == "application/problem+json":
        assert problem(status, headers, answer)["type"] == "/problems/malformed-body"


def test_two_image_parts_are_400_not_first_wins(gunicorn_api):
    response = requests.post(
        gunicorn_api.url + "/v1/jobs",
        timeout=10,
        files=[
            ("image", ("a.jpg", jpeg(64, 64), "image/jpeg")),
            ("image", ("b.jpg", jpeg(64, 64, seed=2), "image/jpeg")),
        ],
    )
    assert response.status_code == 400 and response.json()["invalid_params"][0]["name"] == "image"


@pytest.mark.parametrize("job_id", ["0" * 32 + ":upload", "not-an-id", "A" * 32, "0" * 31])
def test_ids_that_are_not_job_ids_are_404_without_touching_redis(gunicorn_api, stack, job_id):
    stack.redis.set(stack.keys.upload("0" * 32), b"an upload: a string where a job's hash would be", ex=60)
    for method in (requests.get, requests.delete):
        response = method(f"{gunicorn_api.url}/v1/jobs/{job_id}", timeout=10)
        assert response.status_code == 404 and response.json()["type"] == "/problems/job-not-found"


@pytest.mark.parametrize(
    "request_bytes,status",
    [
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"NOT A REQUEST LINE\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Name: y\r\n\r\n", 400),
    ],
)
def test_what_gunicorn_refuses_itself_is_a_problem_document_too(gunicorn_api, request_bytes, status):
    answer_status, headers, body = raw_exchange(gunicorn_api.port, request_bytes)
    assert answer_status == status and headers["connection"] == "close"
    problem(status, headers, body)


def test_a_filename_that_is_not_utf8_gets_an_accurate_400(gunicorn_api):
    image = jpeg(64, 64)
    body = (
        b'--b0undary\r\nContent-Disposition: form-data; name="image"; filename="\xff\xfe\x80.jpg"\r\n'
        b"Content-Type: image/jpeg\r\n\r\n" + image + b"\r\n--b0undary--\r\n"
    )
    status, headers, answer = raw_exchange(
        gunicorn_api.port,
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n"
        b"Connection: close\r\nContent-Type: multipart/form-data; "
        b"boundary=b0undary\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
    )
    assert status == 400 and "not UTF-8" in problem(status, headers, answer)["detail"]


def test_a_body_refused_unread_closes_its_connection_and_says_so(gunicorn_api):
    with socket.create_connection(("127.0.0.1", gunicorn_api.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: 999999999\r\n\r\n" + b"\xff\xd8\xff" + bytes(1000)
        )
        answer = b""
        started = time.monotonic()
        while chunk := sock.recv(65536):
            answer += chunk
        closed_after_s = time.monotonic() - started
    head = answer.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head
    assert closed_after_s < 4  # closed at once, not after reading on until keep-alive ran out (5 s)


def test_scan_bombs_fail_fast_and_an_ordinary_image_beside_them_waits_for_none(stack):
    """Three 2.2 MB progressive JPEGs of 20,006 scans each held every CPU child for the 60 s time limit, and an
    ordinary image waited 59 s behind them: now they are refused from their markers, before a scan is decoded."""
    from tests.support import scan_bomb

    bomb = scan_bomb(8192, 8192, 20_000)
    assert 2_000_000 < len(bomb) < STACK_MAX_UPLOAD
    bombs = [stack.submit_ok(bomb) for _ in range(3)]
    ordinary = stack.submit_ok(jpeg(320, 240))
    started = time.monotonic()
    ended = [stack.wait_terminal(job_id, timeout_s=30) for job_id in bombs]
    doc = stack.wait_terminal(ordinary, timeout_s=30)
    assert [(d["status"], d["error"]["code"]) for d in ended] == [("failed", "image_too_complex")] * 3
    assert doc["status"] == "succeeded" and doc["timings_ms"]["queue_cpu"] < 5000
    assert time.monotonic() - started < 20 and stack.cpu_worker.alive()


def _children_peak_rss_kb(pid: int) -> dict[int, int]:
    """{child pid: its peak resident set (VmHWM, kB)} of a process's children: a Celery worker's pool."""
    peaks = {child: status_kb(child, "VmHWM") for child in children_of(pid)}
    return {child: peak for child, peak in peaks.items() if peak is not None}


def test_hostile_decoder_files_fail_fast_and_bounded_and_an_ordinary_image_waits_for_none(stack):
    """Issue 40's decoder attacks, at this stack's upload limit (3 MB): before, each held a CPU child for
    seconds (a GIF comment bomb, floods of empty JPEG segments and PNG chunks), grew it by hundreds of MB to
    2 GB (EXIF entries that all point at the whole block), or succeeded (a GIF89a+IM polyglot). Now each job
    ends failed with its reason at once, no child grows or is replaced, and an ordinary job sent after them
    waits for none of them."""
    from bench.hostile import files as hostile

    attacks = [
        (hostile.gif_comment_bomb(400_000), "image/gif", "image_too_complex"),
        (hostile.jpeg_exif_bomb(), "image/jpeg", "image_too_complex"),
        (hostile.png_exif_bomb(2_500_000, tags=250), "image/png", "image_too_complex"),
        (hostile.jpeg_comment_flood(2_500_000), "image/jpeg", "image_too_complex"),
        (hostile.png_chunk_flood(2_500_000), "image/png", "image_too_complex"),
        (hostile.gif_im_polyglot(20, 10), "image/gif", "decode_error"),
    ]
    assert all(len(data) < STACK_MAX_UPLOAD for data, _, _ in attacks)
    stack.wait_terminal(stack.submit_ok(jpeg(320, 240)))  # the pool has decoded an image: warm, not attacked
    before = _children_peak_rss_kb(stack.cpu_worker.process.pid)
    started = time.monotonic()
    jobs = []
    for data, media_type, _ in attacks:
        response = stack.submit(data, content_type=media_type)
        assert response.status_code == 202, response.text
        jobs.append(response.json()["id"])
    ordinary = stack.submit_ok(jpeg(320, 240, seed=5))
    ended = [stack.wait_terminal(job_id, timeout_s=30) for job_id in jobs]
    doc = stack.wait_terminal(ordinary, timeout_s=30)
    assert [(d["status"], (d["error"] or {}).get("code")) for d in ended] == [
        ("failed", code) for _, _, code in attacks
    ]
    assert "max_exif_bytes" in ended[2]["error"]["message"] and "PNG chunks" in ended[4]["error"]["message"]
    assert doc["status"] == "succeeded" and doc["timings_ms"]["queue_cpu"] < 2000
    assert time.monotonic() - started < 15 and stack.cpu_worker.alive()
    after = _children_peak_rss_kb(stack.cpu_worker.process.pid)
    assert after.keys() == before.keys(), "a CPU child was replaced"
    assert all(after[pid] - before[pid] < 100 * 1024 for pid in after), (before, after)


@pytest.mark.parametrize("trickle", ["three bytes, then nothing", "one byte a second"])
def test_a_body_that_comes_too_slowly_is_408_and_its_connection_closed(gunicorn_api, trickle):
    """An authenticated POST promising 10,000 bytes was held open unanswered for minutes: the stack's API
    gives a body 2 s plus its size at 64 KiB/s (api.body_timeout_s, body_min_rate)."""
    with socket.create_connection(("127.0.0.1", gunicorn_api.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: 10000\r\n\r\n\xff\xd8\xff"
        )
        started = time.monotonic()
        sock.settimeout(0.05)
        answer, sent = b"", 0
        while time.monotonic() - started < 20:
            if trickle == "one byte a second" and not answer and time.monotonic() - started >= sent:
                try:
                    sock.sendall(b"\x00")
                    sent += 1
                except OSError:
                    break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            answer += chunk
        answered_after = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.lower().startswith(b"http/1.1 408") and b"connection: close" in head.lower(), answer[:300]
    assert 1.5 < answered_after < 8
    assert json.loads(body)["type"] == "/problems/request-timeout"


def test_every_answer_says_nosniff_and_the_docs_page_runs_only_its_own_script_and_frames_nowhere(gunicorn_api):
    docs = requests.get(f"{gunicorn_api.url}/docs", timeout=10)
    assert docs.headers["X-Content-Type-Options"] == "nosniff" and docs.headers["X-Frame-Options"] == "DENY"
    policy = dict(part.strip().split(" ", 1) for part in docs.headers["Content-Security-Policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    # The "Try it" script, from this origin only: none inline, none from elsewhere, fetching from here alone.
    assert policy["script-src"] == "'self'" and policy["connect-src"] == "'self'"
    for response in (
        requests.get(f"{gunicorn_api.url}/v1/models", timeout=10),
        requests.get(f"{gunicorn_api.url}/v1/jobs/{'0' * 32}", timeout=10),
    ):
        assert response.headers["X-Content-Type-Options"] == "nosniff"
    status, headers, _ = raw_exchange(gunicorn_api.port, b"NOT A REQUEST LINE\r\n\r\n")  # gunicorn's own answer
    assert status == 400 and headers["x-content-type-options"] == "nosniff"
