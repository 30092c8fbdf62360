"""Job ids a client can check (issues 59.6 and 60.2): a made-up or mistyped id is 404 before any Redis call, a
lost job's 410 is told to its own key only, and another key's id answers exactly as a missing one does."""

from __future__ import annotations

import dataclasses
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import requests

from app.auth import hash_key
from app.services import services
from contract.jobs.ids import IdVerdict, JobIds, id_secret
from contract.jobs.record import JOB_ID_PATTERN, issued_at, new_job_id
from contract.redis.clock import now as service_now
from contract.settings.config import load_settings
from tests.support import ApiServer, api_with_keys, jpeg

KEY_A, KEY_B = "key-of-team-a-" + "a1" * 8, "key-of-team-b-" + "b2" * 8
SECRET = b"a-job-id-secret-0123456789abcdef"


def _flip(job_id: str, at: int) -> str:
    """`job_id` with the digit at `at` mistyped."""
    return job_id[:at] + ("0" if job_id[at] != "0" else "1") + job_id[at + 1 :]


def test_an_id_is_32_hex_digits_that_pass_their_check_for_their_own_key_only():
    ids = JobIds(SECRET)
    job_id = ids.new("team-a")
    assert __import__("re").fullmatch(JOB_ID_PATTERN, job_id) and job_id[0] == "1"
    assert issued_at(job_id) == pytest.approx(service_now(), abs=1.0)
    assert ids.verdict(job_id, "team-a") is IdVerdict.OURS
    assert ids.verdict(job_id, "team-b") is IdVerdict.NOT_OURS  # another key's
    assert ids.verdict(job_id, "") is IdVerdict.NOT_OURS
    assert JobIds(SECRET[::-1]).verdict(job_id, "team-a") is IdVerdict.NOT_OURS  # another deployment's
    for at in range(1, 32):  # any one digit mistyped
        assert ids.verdict(_flip(job_id, at), "team-a") is IdVerdict.NOT_OURS, at
    made_up = job_id[:12] + secrets.token_hex(10)  # a recent moment, the rest guessed
    assert ids.verdict(made_up, "team-a") is IdVerdict.NOT_OURS
    assert ids.verdict("not-an-id", "team-a") is IdVerdict.NOT_OURS
    assert ids.verdict(job_id.upper(), "team-a") is IdVerdict.NOT_OURS


def test_ids_of_the_format_before_checks_are_read_but_unchecked_and_can_be_refused():
    old = new_job_id()
    assert old[0] == "0" and issued_at(old) == pytest.approx(service_now(), abs=1.0)
    assert JobIds(SECRET).verdict(old, "team-a") is IdVerdict.UNCHECKED
    assert JobIds(SECRET, accept_unchecked=False).verdict(old, "team-a") is IdVerdict.NOT_OURS


def test_the_secret_is_the_setting_else_one_file_made_once_else_derived(tmp_path: Path):
    settings = load_settings()
    made = tmp_path / "var" / "job-id-secret"
    first = id_secret(settings, made)
    assert id_secret(settings, made) == first and len(first) >= 32  # every process of the host reads the same
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert list(made.parent.iterdir()) == [made]  # no draft left behind
    chosen = dataclasses.replace(settings, jobs=dataclasses.replace(settings.jobs, id_secret="set-by-the-operator-42"))
    assert id_secret(chosen, made) == b"set-by-the-operator-42"
    blocked = tmp_path / "a-file" / "job-id-secret"
    blocked.parent.write_text("not a folder")  # var/ cannot be made (a read-only container)
    derived = id_secret(settings, blocked)
    assert derived == id_secret(settings, blocked) != first
    other_redis = dataclasses.replace(settings, redis_url="redis://:another-password-123@redis:6379/0")
    assert id_secret(other_redis, blocked) != derived


@pytest.fixture
def keyed_api(redis_server) -> Iterator[ApiServer]:
    settings = dataclasses.replace(load_settings(), redis_url=redis_server.url, namespace="ids")
    keys = ({"id": "team-a", "sha256": hash_key(KEY_A)}, {"id": "team-b", "sha256": hash_key(KEY_B)})
    with api_with_keys(settings, keys) as api:
        yield api


def _ask(api: ApiServer, key: str, job_id: str, method: str = "GET", wait: float = 0) -> requests.Response:
    path = f"/v1/jobs/{job_id}/callback" if method == "POST" else f"/v1/jobs/{job_id}"
    params = {"wait": str(wait)} if wait else None
    return requests.request(
        method, api.url + path, params=params, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )


def _answer(response: requests.Response, job_id: str) -> tuple[int, str, str]:
    """What a client sees, its id put aside: the status, the type, the body."""
    return response.status_code, response.headers["Content-Type"], response.text.replace(job_id, "<id>")


@contextmanager
def _commands_naming(redis_url: str, text: str) -> Iterator[list[str]]:
    """Every command Redis ran, while the block ran, that names `text` (MONITOR, read up to a marker sent after
    the block: nothing of the block is still on its way when the list is read)."""
    named: list[str] = []
    client = redis.Redis.from_url(redis_url)
    with client.monitor() as monitor:
        yield named
        marker = f"end-of-block-{secrets.token_hex(4)}"
        redis.Redis.from_url(redis_url).echo(marker)
        for event in monitor.listen():
            if marker in event["command"]:
                break
            if text in event["command"]:
                named.append(event["command"])


def _stored(api: ApiServer, job_id: str, owner: str) -> None:
    now = time.time()
    fields = {"model": "shapes-yolo:2.0.0", "received_at": now, "submitted_at": now, "deadline_at": now + 60}
    services(api.app).store.create(job_id, jpeg(64, 48), 600, {**fields, "options": {}, "owner": owner})


def test_a_made_up_or_mistyped_id_is_404_without_a_redis_call(keyed_api, redis_server):
    real = services(keyed_api.app).job_ids.new("team-a")
    _stored(keyed_api, real, "team-a")
    made_up = real[:12] + secrets.token_hex(10)  # this very moment: it was 410 job-lost before issue 60.2
    mistyped = [_flip(real, 20), _flip(real, 30)]  # in its random part, in its check
    for job_id in (made_up, *mistyped):
        with _commands_naming(redis_server.url, job_id) as named:
            answers = [_ask(keyed_api, KEY_A, job_id), _ask(keyed_api, KEY_A, job_id, wait=20)]  # no wait either
        for response in answers:
            assert response.status_code == 404 and response.json()["type"] == "/problems/job-not-found", job_id
            assert response.elapsed.total_seconds() < 5
        assert named == [], named
    assert _ask(keyed_api, KEY_A, real).status_code == 200


def test_an_id_in_the_cells_format_but_not_an_ids_shape_is_404(keyed_api):
    """Its cell's digit is read only from an id that passed its check (JobIds.check): read first, a short or
    non-hex one was a 500 (IndexError, ValueError)."""
    for job_id in ("2abc", "2" + "z" * 31):
        response = _ask(keyed_api, KEY_A, job_id)
        assert response.status_code == 404 and response.json()["type"] == "/problems/job-not-found", job_id
    assert JobIds(SECRET).check("2abc") == (IdVerdict.NOT_OURS, 0)


def test_a_lost_job_is_410_to_its_own_key_and_to_another_exactly_a_missing_one(keyed_api):
    ids = services(keyed_api.app).job_ids
    lost = ids.new("team-a")  # issued to team-a, its record gone
    mine = _ask(keyed_api, KEY_A, lost)
    assert mine.status_code == 410 and mine.json()["type"] == "/problems/job-lost"
    missing = ids.new("team-b", at=service_now() - 2 * 86400)  # team-b's own, long expired
    for method in ("GET", "DELETE", "POST"):
        as_b = _ask(keyed_api, KEY_B, lost, method)
        assert _answer(as_b, lost) == _answer(_ask(keyed_api, KEY_B, missing, method), missing), method
        assert as_b.status_code == 404


def test_a_found_job_reads_normally_and_is_missing_to_another_key(keyed_api):
    job_id = services(keyed_api.app).job_ids.new("team-a")
    _stored(keyed_api, job_id, "team-a")
    read = _ask(keyed_api, KEY_A, job_id)
    assert read.status_code == 200
    assert read.json()["id"] == job_id and read.json()["status"] == "queued"
    made_up = services(keyed_api.app).job_ids.new("team-b")[:24] + "0" * 8
    assert _answer(_ask(keyed_api, KEY_B, job_id), job_id) == _answer(_ask(keyed_api, KEY_B, made_up), made_up)
    cancelled = _ask(keyed_api, KEY_A, job_id, "DELETE")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


def test_a_submitted_job_gets_a_checked_id_its_key_reads(keyed_api):
    submitted = requests.post(
        f"{keyed_api.url}/v1/jobs",
        data=jpeg(64, 48),
        headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "image/jpeg"},
        timeout=10,
    )
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    assert services(keyed_api.app).job_ids.verdict(job_id, "team-a") is IdVerdict.OURS
    assert _ask(keyed_api, KEY_A, job_id).status_code == 200
    assert _ask(keyed_api, KEY_B, job_id).status_code == 404


def test_an_id_of_the_old_format_is_found_or_404_never_410(keyed_api):
    kept, gone = new_job_id(), new_job_id()  # issued before the upgrade: one still stored, one not
    _stored(keyed_api, kept, "team-a")
    assert _ask(keyed_api, KEY_A, kept).status_code == 200
    assert _answer(_ask(keyed_api, KEY_B, kept), kept) == _answer(_ask(keyed_api, KEY_B, gone), gone)
    missing = _ask(keyed_api, KEY_A, gone)
    assert missing.status_code == 404 and missing.json()["type"] == "/problems/job-not-found"


def test_imgserve_job_id_secret_is_taken_as_it_is_and_a_weak_one_refused(monkeypatch):
    from contract.settings.sections import SettingsError

    monkeypatch.setenv("IMGSERVE_JOB_ID_SECRET", "12345678901234567890")  # digits: YAML would make it a number
    assert load_settings().jobs.id_secret == "12345678901234567890"
    monkeypatch.setenv("IMGSERVE_JOB_ID_SECRET", "change-me-please-now")
    with pytest.raises(SettingsError, match="job id secret"):
        load_settings()
