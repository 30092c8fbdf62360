"""`bench peer`: issue 43's synchronous peer beside make run's stack. The arithmetic needs nothing running; the
peer itself runs only where `make peer` installed LitServe (.peer/), which CI does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from bench.load.peer import PEER_PATH, PeerServer, against_peer, litserve_peer, markdown, measure_peer, post_once
from bench.stack.corpus import load_corpus


def run(calls: str, ratio: float, stack_ms: float = 10.0, **extra: Any) -> dict[str, Any]:
    return {
        "calls": calls,
        "achieved_qps": 100.0,
        "latency_ms": {"p95": 300.0},
        "cpu_ms_per_image": {"stack": stack_ms, "redis-main": 1.1},
        "floor": {"decode_floor_ms": 8.0, "stack_over_floor": ratio},
        **extra,
    }


def test_each_of_our_runs_is_set_against_the_peer_runs_on_either_side_of_it() -> None:
    roles = {"peer_roles_ms": {"inference workers": 9.0, "api server": 2.0, "parent": 0.0}}
    results = [run("peer", 1.5, **roles), run("one", 1.8), run("two", 2.0), run("peer", 1.7, **roles), run("one", 2.04)]

    rows = against_peer(results)

    assert [row["run"] for row in rows] == [2, 3, 5]  # the peer's own runs are the reference, not rows
    assert rows[0]["peer_over_floor"] == pytest.approx(1.6)  # the mean of runs 1 and 4
    assert rows[0]["ours_over_peer"] == pytest.approx(1.8 / 1.6, abs=1e-3)
    assert rows[2]["peer_over_floor"] == pytest.approx(1.7)  # no peer run after it: the one before alone
    assert rows[2]["ours_over_peer"] == pytest.approx(1.2)
    assert rows[0]["ours_over_peer_ms"] == pytest.approx(1.0)  # every run here spent 10 ms an image
    text = markdown(results, rows)
    assert "**1.12x**" in text and "**1.20x**" in text
    assert "inference workers 9, api server 2." in text  # a role that spent nothing is left out


def test_without_a_peer_run_there_is_nothing_to_set_ours_against() -> None:
    assert against_peer([run("one", 1.8), run("two", 2.0)]) == []


def test_the_peer_is_refused_with_the_command_that_installs_it_when_it_is_missing(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="make peer"):
        litserve_peer(tmp_path, "fast", 320, peer_path=tmp_path / "nothing-here")


@pytest.mark.integration
def test_a_peer_in_its_own_session_is_loaded_and_counted_like_ours(tmp_path: Path) -> None:
    # The stand-in (tests/peer_standin.py) does the floor's work on each multipart POST, in one process.
    peer = PeerServer(tmp_path, "tests.peer_standin", ["320"])
    try:
        images = load_corpus(count=2)
        with requests.Session() as session:
            bad = session.post(f"{peer.url}/predict", data=b"not a form")
            assert post_once(session, f"{peer.url}/nowhere", images[0]).status == "rejected"
        assert bad.status_code == 400
        result = measure_peer(peer, images, clients=2, duration_s=1.0, size=320)
    finally:
        peer.stop()
    assert peer.process.poll() is not None  # stopped with its session
    assert result["succeeded"] > 0 and not result["failures"]
    assert result["calls"] == "peer"
    assert result["peer_roles_ms"]["parent"] > 0  # its one process, which decoded every image
    assert result["cpu_ms_per_image"]["stack"] == pytest.approx(sum(result["peer_roles_ms"].values()), abs=0.05)
    assert result["floor"]["stack_over_floor"] > 0.5  # each image's decode counted, not just the HTTP


@pytest.mark.slow
@pytest.mark.skipif(not (PEER_PATH / "litserve").is_dir(), reason="LitServe is not installed (make peer)")
def test_the_peer_answers_one_post_per_image_and_its_cpu_is_counted_by_role(tmp_path: Path) -> None:
    peer = litserve_peer(tmp_path, "fast", 320)
    try:
        images = load_corpus(count=2)
        with requests.Session() as session:
            outcome = post_once(session, peer.url, images[0])
        assert outcome.ok and outcome.doc is not None and outcome.doc["status"] == "succeeded"
        result = measure_peer(peer, images, clients=2, duration_s=1.0, size=320)
    finally:
        peer.stop()
    assert result["succeeded"] > 0 and not result["failures"]
    assert result["peer_roles_ms"]["inference workers"] > 0  # the decode is counted where it ran
    assert result["floor"]["stack_over_floor"] > 1.0  # the peer can't decode for less than the floor
