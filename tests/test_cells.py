"""Cells, the API tier's side (docs/cells.md): the `cells` settings, ids that name their cell, the choice of a
cell, the tier's buckets when its Redis is away, and one API over two real redis-servers: jobs placed in both,
read from the one their id names, a cell's Redis killed (SIGKILL) and the submissions going to the other."""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests
import yaml

from app import create_app
from app.cell_choice import Load, less_loaded, two_drawn
from app.cells import redis_address
from app.services import services
from app.tier_buckets import LocalBuckets, TierBuckets
from contract.jobs.ids import CELL_DIGIT, IdVerdict, JobIds
from contract.jobs.record import new_job_id
from contract.redis.keys import Keys
from contract.settings.cell_layout import cells_of
from contract.settings.config import load_settings
from contract.settings.sections import SettingsError
from tests.support import ApiServer, RedisServer, free_port, jpeg, wait_until

SECRET = b"a-job-id-secret-0123456789abcdef"


def _settings(tmp_path: Path, config: dict, environ: dict[str, str] | None = None, monkeypatch=None):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    return load_settings(path)


def test_without_cells_the_one_cell_is_the_top_level_settings_themselves(tmp_path: Path):
    settings = _settings(tmp_path, {"redis_url": "redis://127.0.0.1:6390/0"})
    (only,) = cells_of(settings)
    assert only.index == 0 and only.settings is settings  # nothing rebuilt: every setting keeps its meaning
    assert JobIds(SECRET, cells=1).new("k")[0] == "1"  # and ids keep the format an older API reads


def test_cells_from_a_file_and_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    config = {
        "bulk": {"retry_s": 2.0},
        "cells": [
            {"name": "a", "redis_url": "redis://127.0.0.1:6390/0", "gpu_capacity": 2},
            {
                "name": "b",
                "redis_url": "redis://127.0.0.1:6391/0",
                "bulk": {"redis_urls": ["redis://127.0.0.1:6392/0"]},
            },
        ],
    }
    cells = cells_of(_settings(tmp_path, config))
    assert [(c.name, c.settings.redis_url, c.gpu_capacity) for c in cells] == [
        ("a", "redis://127.0.0.1:6390/0", 2.0),
        ("b", "redis://127.0.0.1:6391/0", 1.0),
    ]
    assert cells[0].settings.bulk.retry_s == 2.0 and cells[0].settings.bulk.redis_urls == ()  # the top level's
    assert cells[1].settings.bulk.redis_urls == ("redis://127.0.0.1:6392/0",)  # its own
    assert cells[1].settings.cells == ()  # a cell's settings are one cell's, as its workers run them
    env = '[{name: x, redis_url: "redis://127.0.0.1:6393/0"}, {name: y, redis_url: "redis://127.0.0.1:6394/0"}]'
    from_env = _settings(tmp_path, config, {"IMGSERVE_CELLS": env}, monkeypatch)
    assert [cell.name for cell in from_env.cells] == ["x", "y"]


@pytest.mark.parametrize(
    "cells, says",
    [
        ([{"name": "A", "redis_url": "redis://h:1/0"}], "must be 1-16"),
        ([{"name": "a", "redis_url": "redis://h:1/0"}, {"name": "a", "redis_url": "redis://h:2/0"}], "listed twice"),
        ([{"name": "a", "redis_url": "redis://h:1/0"}, {"name": "b", "redis_url": "redis://h:1/0"}], "share"),
        ([{"name": "a", "redis_url": "redis://h:1/0", "gpu_capacity": 0}], "gpu_capacity"),
        ([{"name": "a", "redis_url": "http://h:1/0"}], "redis:// URL"),
        ([{"name": "a", "redis_url": "redis://h:1/0", "shards": []}], "shards"),
        ([{"name": f"c{i}", "redis_url": f"redis://h:{i}/0"} for i in range(17)], "at most 16"),
        ([{"name": "a", "redis_url": "redis://:short@h:1/0"}], "password in cell a's redis_url"),
    ],
)
def test_cells_that_cannot_be_used_are_refused(tmp_path: Path, cells: list, says: str):
    with pytest.raises(SettingsError, match=says):
        _settings(tmp_path, {"cells": cells})


def test_an_id_names_its_cell_inside_what_the_secret_signs():
    ids = JobIds(SECRET, cells=3)
    for cell in range(3):
        job_id = ids.new("team-a", cell=cell)
        assert job_id[0] == "2" and JobIds.cell_of(job_id) == cell
        assert ids.verdict(job_id, "team-a") is IdVerdict.OURS
        for other in {0, 1, 2, 15} - {cell}:  # the same id made to name another cell: forged
            forged = job_id[:CELL_DIGIT] + f"{other:x}" + job_id[CELL_DIGIT + 1 :]
            assert ids.verdict(forged, "team-a") is IdVerdict.NOT_OURS
    with pytest.raises(ValueError):
        ids.new("team-a", cell=3)
    # Ids made before cells live in the first cell: format 1 (checked) and 0 (unchecked).
    assert JobIds.cell_of(JobIds(SECRET).new("team-a")) == 0 and JobIds.cell_of(new_job_id()) == 0
    assert ids.verdict(JobIds(SECRET).new("team-a"), "team-a") is IdVerdict.OURS


def test_the_less_loaded_cell_by_drain_time_else_by_backlog_per_capacity():
    busy, idle = Load(backlog=40, rate=20.0), Load(backlog=0, rate=0.0)
    assert less_loaded((idle, 1.0), (busy, 1.0)) and not less_loaded((busy, 1.0), (idle, 1.0))
    assert less_loaded((Load(40, 40.0), 1.0), (Load(30, 10.0), 1.0))  # 1 s of work against 3 s
    dead = Load(backlog=5, unserved=True)  # no live GPU worker serves it: never drains
    assert dead.wait_s() == math.inf and not less_loaded((dead, 4.0), (Load(80, None), 1.0))
    stalled = Load(backlog=5, rate=0.0)  # work waits, nothing drains
    assert not less_loaded((stalled, 1.0), (busy, 1.0))
    unmeasured = Load(backlog=10, rate=None)  # a rate not measured yet: backlog per unit of capacity
    assert less_loaded((unmeasured, 4.0), (Load(5, None), 1.0)) and not less_loaded((Load(50, None), 1.0), (busy, 1.0))


def test_two_cells_are_drawn_in_proportion_to_their_capacity():
    import random

    rng = random.Random(7)
    counts = [0, 0, 0]
    for _ in range(6000):
        first, second = two_drawn([1.0, 1.0, 4.0], rng.random)
        assert first != second
        counts[first] += 1
    assert 0.6 < counts[2] / 6000 < 0.73 and abs(counts[0] - counts[1]) < 300  # 4/6 of first draws


def test_the_tiers_buckets_hold_the_rate_in_this_process_while_its_redis_is_away():
    now = [100.0]
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    buckets = TierBuckets(dead, retry_s=1.0, clock=lambda: now[0])
    taken = [buckets.take("rate:k", 1.0, 2.0).allowed for _ in range(3)]
    assert taken == [True, True, False] and not buckets.up  # the same rate and burst, kept here
    now[0] += 1.5
    assert buckets.up and buckets.take("rate:k", 1.0, 2.0).allowed  # asked again after retry_s; refilled here
    local = LocalBuckets(lambda: now[0])
    assert local.take("x", 2.0, 1.0).allowed and local.take("x", 2.0, 1.0).retry_after_ms == 500


def test_a_redis_address_is_shown_without_its_password():
    assert redis_address("redis://:s3cret-pass@10.0.0.5:6390/2") == "redis://10.0.0.5:6390/2"
    assert redis_address("redis://user:pw@cell-b/0") == "redis://cell-b/0"


@pytest.fixture
def two_cells(tmp_path: Path) -> Iterator[tuple[ApiServer, RedisServer, RedisServer]]:
    """One API (the real app, real HTTP) over two cells, each a private redis-server; no workers."""
    yield from _two_cell_api(tmp_path)


@pytest.fixture
def two_small_cells(tmp_path: Path) -> Iterator[tuple[ApiServer, RedisServer, RedisServer]]:
    """The same, each cell's backlog a model at most 3 jobs, and the first cell drawn first (almost) always: its
    `gpu_capacity` 1000 to the second's 1, so while the loads read are the same (they are read once a second) it
    is the one chosen."""
    yield from _two_cell_api(tmp_path, max_backlog=3, capacities=(1000.0, 1.0))


def _two_cell_api(
    tmp_path: Path, max_backlog: int = 0, capacities: tuple[float, float] = (1.0, 1.0)
) -> Iterator[tuple[ApiServer, RedisServer, RedisServer]]:
    a, b = (RedisServer(_folder(tmp_path / name)) for name in "ab")
    settings = load_settings()
    if max_backlog:
        settings = dataclasses.replace(
            settings, backpressure=dataclasses.replace(settings.backpressure, max_backlog=max_backlog)
        )
    settings = dataclasses.replace(
        settings,
        redis_url=a.url,  # the tier's Redis is the first cell's, as make run CELLS=N runs it
        namespace="cells",
        cache=dataclasses.replace(settings.cache, enabled=False),
        bulk=dataclasses.replace(settings.bulk, retry_s=1.0),
        jobs=dataclasses.replace(settings.jobs, id_secret="cells-test-secret-0123456789abcdef"),
        cells=(),
    )
    from contract.settings.cells import CellSettings

    settings = dataclasses.replace(
        settings,
        cells=(
            CellSettings(name="a", redis_url=a.url, gpu_capacity=capacities[0]),
            CellSettings(name="b", redis_url=b.url, gpu_capacity=capacities[1]),
        ),
    )
    server = ApiServer(create_app(settings))
    yield server, a, b
    server.stop()
    for each in (a, b):
        if each.process.poll() is None:
            each.stop()


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _submit(url: str) -> requests.Response:
    return requests.post(url + "/v1/jobs", data=jpeg(64, 48), headers={"Content-Type": "image/jpeg"}, timeout=30)


def test_one_api_places_jobs_in_both_cells_and_reads_each_where_its_id_says(two_cells):
    server, a, b = two_cells
    keys = Keys("cells")
    clients = [redis.Redis.from_url(a.url), redis.Redis.from_url(b.url)]
    ids = []
    for _ in range(24):
        answer = _submit(server.url)
        assert answer.status_code == 202, answer.text
        ids.append(answer.json()["id"])
    cells = [JobIds.cell_of(job_id) for job_id in ids]
    assert all(job_id[0] == "2" for job_id in ids) and set(cells) == {0, 1}
    for job_id, cell in zip(ids, cells):  # stored in its cell's Redis, and only there
        assert clients[cell].exists(keys.job(job_id)) and not clients[1 - cell].exists(keys.job(job_id))
        read = requests.get(f"{server.url}/v1/jobs/{job_id}", timeout=10)
        assert read.status_code == 200 and read.json()["id"] == job_id
    forged = ids[0][:CELL_DIGIT] + f"{1 - cells[0]:x}" + ids[0][CELL_DIGIT + 1 :]
    assert requests.get(f"{server.url}/v1/jobs/{forged}", timeout=10).status_code == 404
    stats = requests.get(server.url + "/v1/stats", timeout=10).json()["cells"]
    assert [(c["name"], c["status"], c["redis"]) for c in stats["cells"]] == [
        ("a", "up", redis_address(a.url)),
        ("b", "up", redis_address(b.url)),
    ]
    assert stats["totals"]["jobs"]["live"] == 24 and stats["totals"]["backlog"] == 24
    assert sum(c["jobs"]["queued"] for c in stats["cells"]) == 24


def test_a_cell_whose_budget_is_full_hands_the_submission_to_the_other_once(two_small_cells):
    server, a, b = two_small_cells
    # No workers: every job waits. The chooser picks the first cell until its reading of the loads is a second old;
    # full after 3, it hands the 4th over.
    placed = []
    for _ in range(6):
        answer = _submit(server.url)
        assert answer.status_code == 202, answer.text  # a 429 from one cell's backlog is retried on the other
        placed.append(JobIds.cell_of(answer.json()["id"]))
    assert sorted(placed) == [0, 0, 0, 1, 1, 1]
    refused = _submit(server.url)  # both full: the 429 a one-cell deployment gives, with its Retry-After
    assert refused.status_code == 429 and refused.json()["type"].endswith("overloaded")
    assert int(refused.headers["Retry-After"]) >= 1
    stats = requests.get(server.url + "/v1/stats", timeout=10).json()["cells"]
    assert [c["backlog"] for c in stats["cells"]] == [3, 3]  # nothing reserved twice, nothing left behind


def test_a_killed_cell_costs_no_new_submission_a_5xx_and_its_jobs_answer_503(two_cells):
    server, a, b = two_cells
    placed: dict[int, list[str]] = {0: [], 1: []}
    while not (placed[0] and placed[1]):
        job_id = _submit(server.url).json()["id"]
        placed[JobIds.cell_of(job_id)].append(job_id)
    b.process.send_signal(signal.SIGKILL)
    b.process.wait(10)
    after = [_submit(server.url) for _ in range(20)]  # the first finds b dead (if drawn): retried on a
    assert [answer.status_code for answer in after] == [202] * 20, [answer.text for answer in after]
    assert {JobIds.cell_of(answer.json()["id"]) for answer in after} == {0}
    lost_cell = requests.get(f"{server.url}/v1/jobs/{placed[1][0]}", timeout=10)
    assert lost_cell.status_code == 503 and lost_cell.json()["type"].endswith("backend-unavailable")
    long_poll = requests.get(f"{server.url}/v1/jobs/{placed[1][0]}?wait=5", timeout=10)
    assert long_poll.status_code == 503  # a long-poll of a dead cell's job is its 503 too, not a wait
    assert requests.get(f"{server.url}/v1/jobs/{placed[0][0]}", timeout=10).status_code == 200
    stats = requests.get(server.url + "/v1/stats", timeout=10)
    assert stats.status_code == 200
    by_name = {cell["name"]: cell for cell in stats.json()["cells"]["cells"]}
    assert by_name["b"]["status"] == "unavailable" and by_name["b"]["backlog"] is None
    assert by_name["a"]["status"] == "up" and stats.json()["cells"]["totals"]["up"] == 1
    # b comes back empty (no persistence): its jobs are lost (410), and it takes new jobs again.
    b.start()
    wait_until(
        lambda: requests.get(f"{server.url}/v1/jobs/{placed[1][0]}", timeout=10).status_code == 410,
        10,
        what="the emptied cell's job to read as lost",
    )
    wait_until(
        lambda: JobIds.cell_of(_submit(server.url).json()["id"]) == 1, 20, what="a new job in the cell come back"
    )


def test_one_cell_reads_no_load_to_choose(tmp_path: Path):
    server = RedisServer(_folder(tmp_path / "one"))
    settings = dataclasses.replace(load_settings(), redis_url=server.url, namespace="onecell")
    api = ApiServer(create_app(settings))
    try:
        assert _submit(api.url).status_code == 202
        (cell,) = services(api.app).cells
        assert cell.loads._loads == {}  # the choice read nothing
        assert services(api.app).tier is cell.redis and services(api.app).store is cell.store
    finally:
        api.stop()
        server.stop()


def test_the_api_answers_and_limits_rates_while_the_tiers_redis_is_down(tmp_path: Path):
    from app.auth import hash_key
    from contract.settings.cells import CellSettings
    from tests.support import api_with_keys

    cell = RedisServer(_folder(tmp_path / "cell"))
    base = load_settings()
    settings = dataclasses.replace(
        base,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",  # the tier's Redis: nothing listens there
        namespace="tierdown",
        cells=(CellSettings(name="a", redis_url=cell.url),),
        jobs=dataclasses.replace(base.jobs, id_secret="cells-test-secret-0123456789abcdef"),
    )
    key = "a-key-for-the-tier-test-0123456789"
    try:
        with api_with_keys(settings, ({"id": "k", "sha256": hash_key(key)},), rate_per_s=0.5, burst=2.0) as api:
            codes = [
                requests.post(
                    api.url + "/v1/jobs",
                    data=jpeg(64, 48),
                    headers={"Content-Type": "image/jpeg", "Authorization": f"Bearer {key}"},
                    timeout=30,
                ).status_code
                for _ in range(3)
            ]
            assert codes == [202, 202, 429]  # the key's burst, then its rate: kept in the process meanwhile
    finally:
        cell.stop()


class _Loads:
    """A cell's loads as the choice reads them, set by the test (or a Redis that does not answer)."""

    def __init__(self, load: Load | None) -> None:
        self.value, self.reads = load, 0

    def load(self, model_key: str) -> Load:
        self.reads += 1
        if self.value is None:
            raise redis.ConnectionError("refused")
        return self.value


def _cells(*loads: tuple[Load | None, float]):
    from types import SimpleNamespace

    from app.cells import Cells
    from contract.settings.models import Catalogue

    members = [
        SimpleNamespace(name=f"c{i}", gpu_capacity=capacity, loads=_Loads(load), down_until=0.0)
        for i, (load, capacity) in enumerate(loads)
    ]
    now = [0.0]
    cells = Cells(members, JobIds(SECRET, cells=len(members)), Catalogue(load_settings()), 1.0, lambda: now[0])
    return cells, members, now


def test_the_choice_skips_a_cell_that_does_not_drain_or_does_not_answer_and_tries_it_again_later():
    cells, members, now = _cells((Load(3, 30.0), 1.0), (Load(0, unserved=True), 1.0))
    assert {cells.choose(None).name for _ in range(50)} == {"c0"}  # c1's GPU workers are gone
    members[1].loads.value = Load(0, 0.0)  # they are back, and idle
    now[0] += 1.0  # the next reading
    assert cells.choose(None).name == "c1"
    members[1].loads.value = None  # its Redis stops answering: marked down, no new jobs...
    assert cells.choose(None).name == "c0" and not cells.is_up(members[1])
    reads = members[1].loads.reads
    assert {cells.choose(None).name for _ in range(20)} == {"c0"} and members[1].loads.reads == reads
    now[0] += 1.5  # ...until bulk.retry_s has passed: tried again
    members[1].loads.value = Load(0, 0.0)
    assert cells.choose(None).name == "c1"
    assert cells.instead_of(members[1], redis.ConnectionError("x"), None).name == "c0"  # the retry's cell
    assert cells.instead_of(members[0], redis.ResponseError("x"), None) is None  # not a cell that is away


def test_a_job_a_cell_withdrew_for_want_of_replicas_is_made_in_another_cell_and_the_cell_stays_up():
    from contract.redis.replication import AnswerNotReplicated, NotReplicated

    cells, members, _ = _cells((Load(0, 0.0), 1.0), (Load(0, 0.0), 1.0))
    assert cells.instead_of(members[1], NotReplicated(0, 1), None).name == "c0"
    assert cells.is_up(members[1])  # it answered: a failover there, not a cell away
    assert cells.instead_of(members[1], AnswerNotReplicated(0, 1), None) is None  # a job there, ended: kept there
    lone, alone, _ = _cells((Load(0, 0.0), 1.0))
    assert lone.instead_of(alone[0], NotReplicated(0, 1), None) is None  # one cell: the 503 as ever
