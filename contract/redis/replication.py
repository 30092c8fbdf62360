"""What a `202` waits for, in one place: the write, then WAIT on its connection (`execute_and_wait`), for
`redis.replicas_per_write` replicas (`Replication`), or behind Sentinel for the job on every replica the Sentinels
could promote (`DurableWrites`, made by `durable_writes(settings.redis)`); fewer is `NotReplicated` (a 503).

Redis replicates asynchronously and Sentinel promotes, among the replicas the majority of Sentinels can reach,
the one with the most data; it does not look for the replica that holds a given write. `WAIT 1` after a job's
write (what a 202 once waited for) says that *some* replica holds it: a replica on the primary's own
side of a partition, or on its host, acknowledges it, the Sentinels promote one on the other side, and the
old primary and its replica are turned into replicas of the new one, their writes discarded. Measured before
this module: most accepted jobs gone after a partition (docs/benchmarks/2026-12-05-partitions.md; Jepsen's analysis of
Redis, and Redis's own "Sentinel and Redis consistency", explain why).

So a write that a 202 promises waits for **every replica the Sentinels see up** (`DurableWrites.wanted`), never
fewer than `redis.min_replicas`: whichever they promote then holds it, since a replica they see down cannot be
promoted (Sentinel skips replicas it flags down or disconnected), and one that comes back resyncs from the
primary before it acknowledges anything. The count comes from a majority of the configured Sentinels (`SentinelView`,
refreshed every `redis.view_refresh_ms` on a thread of its own); without a majority's answer for
`redis.view_stale_ms`, or when the connection about to carry the write is not on the primary the majority names,
nothing is promised (`Unconfirmed`: 503). Each costs availability, never a promise:

- a replica down is not waited for once the Sentinels flag it (1.5 s, `down-after-milliseconds`);
- after the primary's host is cut off with a replica on it, the new primary has no replica the Sentinels see
  up: 503 until the old side rejoins (with `min_replicas` 1, a 202 always means two servers hold the job);
- the writes of a primary cut off from the majority are never promised, and what it answered to readers is
  checked the same way before a read shows it (`JobIntake.confirm_durable`, the API's read of an ended job).

What remains is named in docs/reliability.md with the scenario that shows it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis

from contract.settings.redis_settings import RedisSettings

log = logging.getLogger(__name__)


class Unconfirmed(redis.ConnectionError):
    """A write could not be promised: no majority of Sentinels answered lately, or the connection is not on the
    primary they name. A ConnectionError: every caller treats it as the store unreachable (503, retry)."""


@dataclass(frozen=True)
class SentinelView:
    """What a majority of the Sentinels said at `at` (monotonic): the primary, and the replicas any of them sees
    up (their addresses)."""

    primary: tuple[str, int]
    replicas_up: frozenset[tuple[str, int]]
    answered: int
    at: float


def majority_view(
    answers: Sequence[tuple[tuple[str, int] | None, list[dict[str, Any]]]], configured: int, at: float
) -> SentinelView | None:
    """The view of the Sentinels that answered, each as (the primary it names, its replicas' states as
    SENTINEL REPLICAS gives them), if a majority of the `configured` ones name one primary; None otherwise. A
    replica counts as up if any Sentinel of that majority sees it up: a count too high costs a wait, one too
    low a promise."""
    majority = configured // 2 + 1  # of the Sentinels configured, not of those that answered
    by_primary: dict[tuple[str, int], list[list[dict[str, Any]]]] = {}
    for primary, replicas in answers:
        if primary is not None:
            by_primary.setdefault(primary, []).append(replicas)
    for primary, lists in by_primary.items():
        if len(lists) >= majority:
            up = {
                (_text(state["ip"]), int(state["port"]))
                for replicas in lists
                for state in replicas
                if _may_hold(state, primary)
            }
            return SentinelView(primary, frozenset(up), len(lists), at)
    return None


class DurableWrites:
    """How many replicas a promised write waits for, and whether a connection is on the primary to promise it
    from (see the module's note). `refresh()` asks every Sentinel; `start()` does it on a thread every
    `refresh_s`."""

    def __init__(
        self,
        sentinels: Sequence[redis.Redis],
        service: str,
        min_replicas: int,
        refresh_s: float = 0.5,
        stale_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sentinels = list(sentinels)
        self.service = service
        self.min_replicas = min_replicas
        self.refresh_s = refresh_s
        self.stale_s = stale_s
        self._monotonic = monotonic
        self.view: SentinelView | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def refresh(self) -> SentinelView | None:
        """Ask every Sentinel (in turn; each bounded by its client's timeouts): the new view if a majority named
        one primary, else None (the last view stands until it is stale). Stamped with the moment the asking
        began: a slow Sentinel must not make the view look fresher than its first answer."""
        began = self._monotonic()
        answers = []
        for sentinel in self.sentinels:
            try:
                pipe = sentinel.pipeline(transaction=False)
                pipe.sentinel_get_master_addr_by_name(self.service)
                pipe.sentinel_slaves(self.service)
                address, replicas = pipe.execute()
            except (redis.RedisError, OSError):
                continue
            primary = (_text(address[0]), int(address[1])) if address else None
            answers.append((primary, replicas or []))
        view = majority_view(answers, len(self.sentinels), began)
        if view is not None:
            if self.view is not None and view.primary != self.view.primary:
                log.warning("the Sentinels' majority names a new primary: %s:%d", *view.primary)
            self.view = view
        return view

    def current(self) -> SentinelView:
        """The latest view, if it is fresh; Unconfirmed otherwise (no majority answered for `stale_s`)."""
        self._ensure_running()
        view = self.view
        if view is None or self._monotonic() - view.at > self.stale_s:
            raise Unconfirmed("no majority of the Sentinels confirmed the primary lately")
        return view

    def wanted(self, view: SentinelView | None = None) -> int:
        """Replicas a promised write must reach: every one the Sentinels see up (in `view`, or the current view),
        at least `min_replicas`."""
        return max(self.min_replicas, len((view or self.current()).replicas_up))

    def check_primary(self, address: tuple[str, int]) -> None:
        """Unconfirmed unless `address` is the primary the Sentinels' majority names."""
        primary = self.current().primary
        if (_text(address[0]), int(address[1])) != primary:
            raise Unconfirmed(
                f"{address[0]}:{address[1]} is not the primary the Sentinels name ({primary[0]}:{primary[1]})"
            )

    def start(self) -> None:
        """A first view now, then one every `refresh_s` on a daemon thread (started again after a fork)."""
        self.refresh()
        self._ensure_running()

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._refresh_forever, name="sentinel-view", daemon=True)
                self._thread.start()

    def _refresh_forever(self) -> None:
        while True:
            started = self._monotonic()
            try:
                self.refresh()
            except Exception:  # a reply it cannot read must not end the view for good
                log.exception("sentinel view: a refresh failed")
            time.sleep(max(0.05, self.refresh_s - (self._monotonic() - started)))


class SharedFence:
    """Confirms, for every thread that read something from the primary, that what it read is on the replicas:
    one confirmation round in flight at a time (`round_trip`: a write on the replication stream, then WAIT;
    True when enough replicas acknowledged it), shared by every reader that read before the round began. A
    replica's acknowledged offset covers everything the primary wrote before the round's write, so a reader is
    covered by the first round that starts after its read. So readers hold no connection while they wait, and
    a burst of reads costs one round, not one each (one each, while the replicas lagged after a failover, held
    every connection of the API's pool for a second apiece)."""

    def __init__(self, round_trip: Callable[[], bool]) -> None:
        self._round_trip = round_trip
        self._changed = threading.Condition()
        self._started = 0  # rounds begun
        self._finished = 0  # rounds over (in order: one at a time)
        self._outcomes: dict[int, bool] = {}  # the last few rounds' outcomes
        self._in_flight = False
        self._waiting = 0  # readers waiting for a round another reader runs

    @property
    def waiting(self) -> int:
        """How many readers wait for a round another reader runs (a test's view of a burst: one round covers it)."""
        with self._changed:
            return self._waiting

    def confirm(self) -> bool:
        """True once a round that began after this call was acknowledged; False when that round was not (the
        caller says so: the reader asks again). A round that raises passes its error to the threads it covers."""
        with self._changed:
            mine = self._started + 1  # the first round to begin from now on covers this read
            while self._finished < mine:
                if not self._in_flight:
                    self._in_flight, self._started = True, self._started + 1
                    number = self._started
                    self._changed.release()
                    try:
                        outcome: bool | BaseException = self._round_trip()
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiters below, then raised
                        outcome = exc
                    finally:
                        self._changed.acquire()
                    self._in_flight, self._finished = False, number
                    self._outcomes[number] = outcome if isinstance(outcome, bool) else False
                    self._outcomes.pop(number - 64, None)
                    self._changed.notify_all()
                    if number == mine and isinstance(outcome, BaseException):
                        raise outcome
                else:
                    self._waiting += 1
                    try:
                        self._changed.wait()
                    finally:
                        self._waiting -= 1
            return self._outcomes.get(mine, False)


def missing_from(view: SentinelView, written: Any, acknowledged: Any) -> frozenset[tuple[str, int]]:
    """The replicas `view` sees up that have not acknowledged a write: `written` is the primary's ROLE read
    just after the write (its replication offset then), `acknowledged` its ROLE after WAIT (each replica's
    acknowledged offset). WAIT counts replicas, not which ones: a replica the Sentinels see down (cut off from
    them, still linked to the primary on its side) fills the count as well as the one they would promote, so
    the count alone could promise a write the next primary lacks. A reply that is not a primary's counts every
    replica as missing."""
    if not _is_primary_role(written) or not _is_primary_role(acknowledged):
        return view.replicas_up
    offset = int(written[1])
    holding = {(_text(ip), int(port)) for ip, port, acked in acknowledged[2] if int(acked) >= offset}
    return view.replicas_up - holding


def _is_primary_role(reply: Any) -> bool:
    return isinstance(reply, list) and len(reply) >= 3 and _text(reply[0]) == "master"


def _may_hold(state: dict[str, Any], primary: tuple[str, int]) -> bool:
    """A replica to wait for: one a Sentinel sees up and replicating from `primary` (or syncing from it: WAIT
    waits for it to finish). One that reports itself a primary (an old primary back after a failover, for the
    seconds before the Sentinels turn it into a replica), or still follows the old primary (until they reconfigure
    it), cannot acknowledge the primary's writes: it is not waited for."""
    down = state.get("is_sdown") or state.get("is_odown") or state.get("is_disconnected")
    if down or _text(state.get("role-reported", "slave")) != "slave":
        return False
    host, port = state.get("master-host"), state.get("master-port")
    return host is None or port is None or (_text(host), int(port)) == primary


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- the write and its wait: what the API's intake and reads run (contract.jobs.intake) ------------------------


class NotReplicated(redis.RedisError):
    """A write that fewer replicas than asked acknowledged in time (WAIT): it may be lost in a failover."""

    def __init__(self, acknowledged: int, wanted: int) -> None:
        super().__init__(f"{acknowledged} of {wanted} replica(s) acknowledged the write in time")
        self.acknowledged, self.wanted = acknowledged, wanted


class AnswerNotReplicated(NotReplicated):
    """How a job ended is on fewer replicas than a 202 waits for: a read must not show it yet (a failover now
    could take it back). The reader asks again."""


def execute_and_wait(
    client: redis.Redis,
    commands: Sequence[tuple[Any, ...]],
    replicas: int,
    timeout_ms: int,
    check_primary: Callable[[tuple[str, int]], None] | None = None,
    then: Sequence[tuple[Any, ...]] = (),
) -> tuple[list[Any], int]:
    """`commands`, then, on the same connection, WAIT for `replicas` replicas, at most `timeout_ms`, then `then`:
    (the replies of `commands` and `then`, raw, without response callbacks; how many replicas acknowledged).
    WAIT counts the replicas that
    acknowledged everything this connection wrote, so it must follow the writes on their own connection:
    redis-py's pipeline hands its connection back before anything can follow it, and a WAIT inside MULTI
    returns at once. A reply that is an error (or holds one: EXEC's) is raised as ResponseError.
    `check_primary(address)`: raises before anything is sent when the connection's server is not the one to
    write to (contract.redis.replication: a primary the Sentinels' majority no longer names); the connection and the
    pool's idle ones are dropped, so that the next ask the Sentinels again."""
    pool = client.connection_pool
    connection: Any = pool.get_connection()  # redis-py's Connection methods are untyped; connected already
    try:
        if check_primary is not None:
            try:
                check_primary((connection.host, connection.port))
            except redis.ConnectionError:
                pool.disconnect(inuse_connections=False)  # the idle ones are on the same server: all ask again
                raise
        connection.send_packed_command(connection.pack_commands([*commands, ("WAIT", replicas, timeout_ms), *then]))
        replies = [connection.read_response() for _ in range(len(commands) + 1 + len(then))]
    except BaseException:
        connection.disconnect()  # a reply half read would be the next user's
        raise
    finally:
        pool.release(connection)
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
        if isinstance(reply, list):
            for item in reply:  # EXEC's replies, one per queued command
                if isinstance(item, redis.ResponseError):
                    raise item
    waited = len(commands)
    return replies[:waited] + replies[waited + 1 :], int(replies[waited])


class Replication(NamedTuple):
    """How many replicas a new job must reach (Redis WAIT) before the API says 202, and for how long it waits
    (settings.redis: replicas_per_write, replica_timeout_ms). 0: no wait. Behind Sentinel, `durable` says how
    many (every replica the Sentinels see up, at least `replicas`) and on which server (contract.redis.replication)."""

    replicas: int = 0
    timeout_ms: int = 1000
    durable: DurableWrites | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.replicas) or self.durable is not None

    def wait(self, client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> tuple[list[Any], int, int]:
        """`commands` on the primary, then WAIT for the wanted replicas: (replies, acknowledged, wanted). Behind
        Sentinel, the primary's ROLE just after the write and again after WAIT says *which* replicas hold it:
        one the Sentinels see up without it counts as not acknowledged, whatever WAIT counted (see
        replication.missing_from). Both ROLEs travel with the write: no round trip more."""
        if self.durable is None:
            replies, acknowledged = execute_and_wait(client, commands, self.replicas, self.timeout_ms)
            return replies, acknowledged, self.replicas
        view = self.durable.current()
        wanted = self.durable.wanted(view)
        replies, acknowledged = execute_and_wait(
            client, [*commands, ("ROLE",)], wanted, self.timeout_ms, self.durable.check_primary, then=[("ROLE",)]
        )
        *replies, written, after = replies
        if missing := missing_from(view, written, after):
            acknowledged = min(acknowledged, len(view.replicas_up - missing))
        return replies, acknowledged, wanted


NO_REPLICATION = Replication()


def durable_writes(section: RedisSettings) -> DurableWrites | None:
    """Behind Sentinel, what a promised write waits for (contract.redis.replication), asking each Sentinel with a
    short timeout of its own (a Sentinel cut off must not hold a refresh for long); None without Sentinels."""
    if not section.sentinels:
        return None
    timeout = section.sentinel_timeout_ms / 1000.0
    clients = [
        redis.Redis(
            host=host,
            port=port,
            password=section.sentinel_password or None,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
        )
        for host, port in section.sentinel_addresses()
    ]
    return DurableWrites(
        clients,
        section.service,
        section.replicas_per_write,
        refresh_s=section.view_refresh_ms / 1000.0,
        stale_s=section.view_stale_ms / 1000.0,
    )
