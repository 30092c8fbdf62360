"""What a 202 waits for behind Sentinel (contract.redis.replication): the majority's view of the primary and of the
replicas that may hold a write, and the fence that readers share. The pure parts here; a real Redis set in
tests/test_failover.py and the partitions in tests/test_partitions.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from bench.stack.processes import wait_until
from contract.redis.replication import DurableWrites, SharedFence, Unconfirmed, majority_view

A, B, C = ("10.0.0.1", 6379), ("10.0.0.2", 6379), ("10.0.0.3", 6379)


def replica(address: tuple[str, int], following: tuple[str, int] = A, **flags: Any) -> dict[str, Any]:
    return {
        "ip": address[0],
        "port": address[1],
        "role-reported": flags.pop("role", "slave"),
        "master-host": following[0],
        "master-port": following[1],
        **flags,
    }


def test_a_majority_of_the_configured_sentinels_must_name_one_primary():
    both = [replica(B), replica(C)]
    assert majority_view([(A, both)], configured=3, at=0.0) is None  # one of three answered
    assert majority_view([(A, both), (B, both)], configured=3, at=0.0) is None  # two, naming two primaries
    view = majority_view([(A, both), (A, both), (None, [])], configured=3, at=5.0)
    assert view is not None and view.primary == A and view.answered == 2 and view.at == 5.0
    assert view.replicas_up == {B, C}


def test_a_replica_any_sentinel_of_the_majority_sees_up_and_following_the_primary_is_waited_for():
    seen_by_one = [replica(B), replica(C, is_sdown=True)]
    seen_by_other = [replica(B, is_sdown=True), replica(C)]
    view = majority_view([(A, seen_by_one), (A, seen_by_other)], configured=3, at=0.0)
    assert view is not None and view.replicas_up == {B, C}  # a count too high costs a wait, too low a promise


@pytest.mark.parametrize(
    "state",
    [
        replica(B, is_sdown=True),
        replica(B, is_odown=True),
        replica(B, is_disconnected=True),
        replica(B, role="master"),  # an old primary back, before the Sentinels turn it
        replica(B, following=C),  # still following another primary
    ],
)
def test_a_replica_that_cannot_acknowledge_the_primarys_writes_is_not_waited_for(state):
    view = majority_view([(A, [state]), (A, [state])], configured=3, at=0.0)
    assert view is not None and view.replicas_up == frozenset()


class FakeSentinel:
    """A stand-in for a Sentinel's client in a pure test of DurableWrites' arithmetic (its pipeline's two
    answers); the real Sentinels are in tests/test_failover.py and tests/test_partitions.py."""

    def __init__(self, primary: tuple[str, int] | None, replicas: list[dict[str, Any]]) -> None:
        self.primary, self.replicas, self.down = primary, replicas, False

    def pipeline(self, transaction: bool = False) -> FakeSentinel:
        return self

    def sentinel_get_master_addr_by_name(self, service: str) -> None:
        pass

    def sentinel_slaves(self, service: str) -> None:
        pass

    def execute(self) -> list[Any]:
        import redis

        if self.down:
            raise redis.ConnectionError("cut off")
        return [self.primary, self.replicas]


def test_writes_wait_for_every_replica_up_at_least_min_replicas_and_only_on_the_named_primary():
    now = [100.0]
    sentinels = [FakeSentinel(A, [replica(B), replica(C)]) for _ in range(3)]
    durable = DurableWrites(sentinels, "imgserve", min_replicas=1, stale_s=2.0, monotonic=lambda: now[0])
    durable._ensure_running = lambda: None  # type: ignore[method-assign]  # refreshed by hand here
    durable.refresh()
    assert durable.wanted() == 2
    durable.check_primary(A)
    with pytest.raises(Unconfirmed):
        durable.check_primary(B)
    for sentinel in sentinels:
        sentinel.replicas = []  # both replicas gone
    durable.refresh()
    assert durable.wanted() == 1  # never fewer than min_replicas
    for sentinel in sentinels[1:]:
        sentinel.down = True  # this process is cut off from the majority
    assert durable.refresh() is None
    now[0] += 1.0
    assert durable.wanted() == 1  # the last view holds until it is stale
    now[0] += 1.5
    with pytest.raises(Unconfirmed, match="majority"):
        durable.wanted()


def test_readers_share_fence_rounds_and_a_round_covers_only_reads_made_before_it_began():
    started, release = threading.Event(), threading.Event()
    rounds: list[int] = []

    def round_trip() -> bool:
        rounds.append(len(rounds) + 1)
        if len(rounds) == 1:
            started.set()
            release.wait(5)
        return True

    fence = SharedFence(round_trip)
    results: list[bool] = []
    first = threading.Thread(target=lambda: results.append(fence.confirm()))
    first.start()
    assert started.wait(5)
    # Three reads made while round 1 is in flight: round 1 began before them, so one more round covers all three.
    waiters = [threading.Thread(target=lambda: results.append(fence.confirm())) for _ in range(3)]
    for thread in waiters:
        thread.start()
    wait_until(lambda: fence.waiting == 3, 5, what="three readers waiting behind round 1")
    release.set()
    for thread in [first, *waiters]:
        thread.join(5)
    assert results == [True] * 4
    assert rounds == [1, 2]


def test_a_round_that_fails_fails_every_read_it_covers():
    outcomes = iter([False, True])
    fence = SharedFence(lambda: next(outcomes))
    assert fence.confirm() is False
    assert fence.confirm() is True


def test_a_write_held_only_by_a_replica_the_sentinels_see_down_is_not_acknowledged(tmp_path):
    """WAIT counts replicas, not which ones. The primary's host keeps a replica the Sentinels see down (their
    link to it cut), while the one they see up is cut off from the primary: WAIT 1 is met by the wrong one,
    and a promotion of the one they see up would lose the job. Real servers: a primary, a linked replica, and a
    server the fake Sentinels call its other replica, which never links."""
    import redis

    from contract.redis.replication import Replication
    from tests.support import RedisServer, wait_until

    for name in ("primary", "linked", "away"):
        (tmp_path / name).mkdir()
    primary, linked, away = (RedisServer(tmp_path / name) for name in ("primary", "linked", "away"))
    try:
        redis.Redis(host="127.0.0.1", port=linked.port).replicaof("127.0.0.1", primary.port)
        client = redis.Redis(host="127.0.0.1", port=primary.port)
        linked_client = redis.Redis(host="127.0.0.1", port=linked.port)
        wait_until(lambda: linked_client.info("replication")["master_link_status"] == "up", 10, what="the link")
        wait_until(lambda: any(int(port) == linked.port for _, port, _ in client.role()[2]), 10, what="the sync")
        here, linked_at, away_at = (("127.0.0.1", server.port) for server in (primary, linked, away))

        def replication(up: list[tuple[str, int]], down: list[tuple[str, int]]) -> Replication:
            states = [replica(address, following=here) for address in up]
            states += [replica(address, following=here, is_sdown=True) for address in down]
            durable = DurableWrites([FakeSentinel(here, states) for _ in range(3)], "imgserve", min_replicas=1)
            durable._ensure_running = lambda: None  # type: ignore[method-assign]  # refreshed by hand here
            durable.refresh()
            return Replication(replicas=1, timeout_ms=2000, durable=durable)

        replies, acknowledged, wanted = replication(up=[away_at], down=[linked_at]).wait(client, [("SET", "k", "1")])
        assert replies == [b"OK"] and wanted == 1
        assert acknowledged == 0  # WAIT alone said 1: the linked replica, which the Sentinels would not promote
        assert linked_client.get("k") == b"1" and redis.Redis(host="127.0.0.1", port=away.port).get("k") is None
        replies, acknowledged, wanted = replication(up=[linked_at], down=[away_at]).wait(client, [("SET", "k", "2")])
        assert (replies, acknowledged, wanted) == ([b"OK"], 1, 1)  # the replica they would promote holds it
    finally:
        for server in (primary, linked, away):
            server.stop()
