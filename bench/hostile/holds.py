"""`bench hostile --attack long-polls / trickle`: issue 52's connection attacks against a live local stack (two API
processes under gunicorn, gevent, as deployed), and what the service's health and another key saw meanwhile.

long-polls: one key holds `--holds` (4,000) long-polls `GET /v1/jobs/<live job>?wait=30` open at once, each on a
connection of its own; every answer (a 429, or the wait's end) is followed by the same request on a new
connection, after the answer's Retry-After (the attacker goes on for as long as the attack lasts). The live job is
a record written in the stack's Redis, queued with an hour to its deadline: a job stuck behind a backlog.

trickle: one key keeps `--bodies` (40) submissions open, each declaring a 20 MiB body and sending all of it but
its last 64 bytes, then a byte every 5 s (well within the body's 330 s deadline); a refused or closed one starts
again after its Retry-After. With the result cache on (the default), as the probe ran it.

Meanwhile: /healthz every 0.25 s and another key's submission of a photo every 0.5 s, each on a new connection
(a keep-alive connection would skip the listen backlog the attack fills); for trickle, the API processes'
resident memory every 0.5 s. The connections are raw sockets driven by one selector (threads would not hold
4,000 of them here).
"""

from __future__ import annotations

import contextlib
import resource
import selectors
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import requests

from bench.hostile.attacks import _pick, keyed_stack_options
from bench.stack.local import LocalStack, StackOptions

BODY_BYTES = 20 * 1024 * 1024


@dataclass
class Conn:
    """One attacking connection: what it still has to send, what it was sent back, when it may start again."""

    sock: socket.socket | None = None
    pending: memoryview = field(default_factory=lambda: memoryview(b""))
    answer: bytes = b""
    sent_at: float = 0.0
    again_at: float = 0.0
    trickle_at: float = 0.0


class Attacker:
    """`count` connections, each sending `request()` and starting again once answered or closed (after the
    answer's Retry-After); with `trickle_s`, a connection that has sent all but its last `hold_back` bytes sends
    one byte every `trickle_s`."""

    def __init__(
        self,
        port: int,
        count: int,
        request: Callable[[], bytes],
        trickle_s: float = 0.0,
        hold_back: int = 0,
        honour_retry_after: bool = True,
    ):
        self.port, self.count, self.request = port, count, request
        self.honour_retry_after = honour_retry_after
        self.trickle_s, self.hold_back = trickle_s, hold_back
        self.statuses: Counter[str] = Counter()
        self.held_samples: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        conns = [Conn() for _ in range(self.count)]
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                for conn in conns:
                    if conn.sock is None and now >= conn.again_at:
                        self._open(selector, conn)
                    elif conn.sock is not None and self.trickle_s and not conn.pending and now >= conn.trickle_at:
                        self._trickle(selector, conn, now)
                for key, events in selector.select(timeout=0.05):
                    self._serve(selector, key.data, events)
                self.held_samples.append(sum(1 for c in conns if c.sock is not None and not c.answer))
        finally:
            for conn in conns:
                if conn.sock is not None:
                    conn.sock.close()
            selector.close()

    def _open(self, selector: selectors.BaseSelector, conn: Conn) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect(("127.0.0.1", self.port))
        conn.sock, conn.answer, conn.sent_at = sock, b"", time.monotonic()
        data = self.request()
        conn.pending = memoryview(data)[: len(data) - self.hold_back]
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _trickle(self, selector: selectors.BaseSelector, conn: Conn, now: float) -> None:
        conn.trickle_at = now + self.trickle_s
        conn.pending = memoryview(b"\xff")
        selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)  # type: ignore[arg-type]

    def _serve(self, selector: selectors.BaseSelector, conn: Conn, events: int) -> None:
        sock = conn.sock
        assert sock is not None
        try:
            if events & selectors.EVENT_WRITE and conn.pending:
                sent = sock.send(conn.pending)
                conn.pending = conn.pending[sent:]
                if not conn.pending:
                    selector.modify(sock, selectors.EVENT_READ, conn)
                    conn.trickle_at = time.monotonic() + self.trickle_s
                return
            if events & selectors.EVENT_READ:
                chunk = sock.recv(65536)
                conn.answer += chunk
                if chunk and b"\r\n\r\n" not in conn.answer:
                    return
        except BlockingIOError:
            return
        except OSError:
            pass  # refused or reset: the server closed it with our bytes unread
        self._finish(selector, conn)

    def _finish(self, selector: selectors.BaseSelector, conn: Conn) -> None:
        head = conn.answer.partition(b"\r\n\r\n")[0].decode("latin-1")
        status = head.split(" ", 2)[1] if head.startswith("HTTP/") else "closed"
        self.statuses[status] += 1
        lines = head.split("\r\n")
        retry = next((line.split(":", 1)[1] for line in lines if line.lower().startswith("retry-after")), "0")
        selector.unregister(conn.sock)  # type: ignore[arg-type]
        conn.sock.close()  # type: ignore[union-attr]
        conn.sock, conn.pending = None, memoryview(b"")
        conn.again_at = time.monotonic() + (float(retry.strip() or 0) if self.honour_retry_after else 0.0)


class Probes:
    """/healthz every 0.25 s and the other key's submission every 0.5 s, new connections each; latencies in s."""

    def __init__(self, url: str, key: str, image: bytes) -> None:
        self.url, self.key, self.image = url, key, image
        self.health: list[tuple[float, float | None]] = []  # (when, latency or None: no answer within 60 s)
        self.submits: list[tuple[float, int, float]] = []  # (when, status, latency)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._health, daemon=True), threading.Thread(target=self._submit)]

    def start(self) -> Probes:
        for thread in self.threads:
            thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _health(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                ok = requests.get(self.url + "/healthz", timeout=60).status_code == 200
                self.health.append((started, time.monotonic() - started if ok else None))
            except requests.RequestException:
                self.health.append((started, None))
            self.stop.wait(max(0.0, started + 0.25 - time.monotonic()))

    def _submit(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "image/jpeg", "Connection": "close"}
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                status = requests.post(self.url + "/v1/jobs", data=self.image, headers=headers, timeout=60).status_code
            except requests.RequestException:
                status = 0
            self.submits.append((started, status, time.monotonic() - started))
            self.stop.wait(max(0.0, started + 0.5 - time.monotonic()))

    def summary(self, since: float, until: float) -> dict[str, Any]:
        health = [latency for when, latency in self.health if since <= when < until]
        answered = sorted(latency for latency in health if latency is not None)
        submits = [(status, latency) for when, status, latency in self.submits if since <= when < until]
        taken = sorted(latency for _, latency in submits)
        slow = [
            (round(when - since, 1), None if latency is None else round(latency, 2))
            for when, latency in self.health
            if since <= when < until and (latency is None or latency > 1.0)
        ]
        return {
            "healthz": {
                "n": len(health),
                "unanswered": len(health) - len(answered),
                "p50_s": _pick(answered, 50),
                "p95_s": _pick(answered, 95),
                "max_s": _pick(answered, 100),
                "over_1s_at": slow,
            },
            "other_key_submits": {
                "n": len(submits),
                "statuses": dict(Counter(str(s) for s, _ in submits)),
                "p50_s": _pick(taken, 50),
                "max_s": _pick(taken, 100),
            },
        }


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, needed), hard))


def _api_rss_mb(stack: LocalStack) -> list[float]:
    """Each gunicorn worker's resident memory (the API's processes but its master, which serves nothing)."""
    from bench.hostile.images import _children_rss_kb

    return [kb / 1024 for kb in _children_rss_kb(stack.process("api").process.pid).values()]


def _live_job(stack: LocalStack, owner: str) -> str:
    assert stack.redis is not None
    client = redis.Redis.from_url(stack.redis.url)
    job_id = uuid.uuid4().hex
    now = time.time()
    fields = {"id": job_id, "status": "queued", "owner": owner, "received_at": now, "deadline_at": now + 3600}
    client.hset(f"imgserve:job:{job_id}", mapping=fields)  # type: ignore[arg-type]  # redis-py's own types
    client.expire(f"imgserve:job:{job_id}", 3600)
    return job_id


def long_polls(
    options: StackOptions,
    images: list[bytes],
    holds: int = 4000,
    duration_s: float = 60.0,
    log: Callable[[str], None] = print,
    honour_retry_after: bool = True,
    **_ignored: Any,
) -> dict[str, Any]:
    """Finding 3: one key's `holds` long-polls against a live job; /healthz and another key's submissions."""
    _raise_fd_limit(holds + 2000)  # this process's sockets, and (inherited) each API process's
    workdir = Path(tempfile.mkdtemp(prefix="hostile-"))
    options, keys = keyed_stack_options(options, workdir, callback_worker=False)
    stack = LocalStack(workdir, options).start()
    port = int(stack.url.rsplit(":", 1)[1])
    try:
        job = _live_job(stack, "attacker")
        request = (
            f"GET /v1/jobs/{job}?wait=30 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys['attacker']}\r\n\r\n"
        ).encode()
        probes = Probes(stack.url, keys["tenant"], images[0]).start()
        time.sleep(5.0)
        attacker = Attacker(port, holds, lambda: request, honour_retry_after=honour_retry_after)
        attack_started = time.monotonic()
        thread = threading.Thread(target=attacker.run, daemon=True)
        thread.start()
        log(f"holding {holds} long-polls for {duration_s:g} s")
        time.sleep(duration_s)
        attack_ended = time.monotonic()
        attacker.stop.set()
        thread.join(30)
        time.sleep(3.0)
        probes.finish()
    finally:
        stack.stop()
    held = sorted(attacker.held_samples[len(attacker.held_samples) // 2 :])  # the attack's second half
    return {
        "holds": holds,
        "honour_retry_after": honour_retry_after,
        "duration_s": duration_s,
        "answers": dict(attacker.statuses),
        "unanswered_connections_median": _pick([float(h) for h in held], 50),
        "quiet": probes.summary(attack_started - 5.0, attack_started),
        "attack": probes.summary(attack_started, attack_ended),
    }


def format_long_polls(outcome: dict[str, Any]) -> str:
    lines = [
        f"long-polls: one key holding {outcome['holds']} GET ?wait=30 for {outcome['duration_s']:g} s"
        f"{'' if outcome.get('honour_retry_after', True) else ', each answered one sent again at once'}; its answers "
        f"{outcome['answers']}; connections awaiting an answer, median of the second half: "
        f"{outcome['unanswered_connections_median']}",
    ]
    for phase in ("quiet", "attack"):
        health, submits = outcome[phase]["healthz"], outcome[phase]["other_key_submits"]
        lines.append(
            f"  {phase}: /healthz p50 {health['p50_s']} s, p95 {health['p95_s']} s, max {health['max_s']} s "
            f"({health['n']} probes, {health['unanswered']} unanswered in 60 s; over 1 s at (s, s): "
            f"{health['over_1s_at']}); the other key's submissions "
            f"{submits['statuses']} p50 {submits['p50_s']} s, max {submits['max_s']} s"
        )
    return "\n".join(lines)


def trickle(
    options: StackOptions,
    images: list[bytes],
    bodies: int = 40,
    duration_s: float = 60.0,
    log: Callable[[str], None] = print,
    **_ignored: Any,
) -> dict[str, Any]:
    """Finding 5: one key's `bodies` 20 MiB bodies held all but their last 64 bytes; the API's memory."""
    workdir = Path(tempfile.mkdtemp(prefix="hostile-"))
    options, keys = keyed_stack_options(options, workdir, callback_worker=False)
    options.extra = {**options.extra, "cache": {"enabled": True}}  # the default, as the probe ran it
    stack = LocalStack(workdir, options).start()
    port = int(stack.url.rsplit(":", 1)[1])
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys['attacker']}\r\n"
        f"Content-Type: image/jpeg\r\nContent-Length: {BODY_BYTES}\r\n\r\n"
    ).encode()
    body = head + b"\xff\xd8\xff" + b"\x00" * (BODY_BYTES - 3)
    samples: list[list[float]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            samples.append(_api_rss_mb(stack))
            sampling.wait(0.5)

    try:
        probes = Probes(stack.url, keys["tenant"], images[0]).start()
        time.sleep(5.0)
        quiet = _api_rss_mb(stack)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        attacker = Attacker(port, bodies, lambda: body, trickle_s=5.0, hold_back=64)
        attack_started = time.monotonic()
        thread = threading.Thread(target=attacker.run, daemon=True)
        thread.start()
        log(f"{bodies} bodies of {BODY_BYTES} bytes trickling for {duration_s:g} s")
        time.sleep(duration_s)
        attack_ended = time.monotonic()
        attacker.stop.set()
        thread.join(30)
        sampling.set()
        sampler.join(10)
        probes.finish()
    finally:
        stack.stop()
    return {
        "bodies": bodies,
        "duration_s": duration_s,
        "answers": dict(attacker.statuses),
        "api_rss_mb": {
            "quiet_each": [round(mb) for mb in quiet],
            "peak_each": [round(max((s[i] for s in samples if len(s) > i), default=0)) for i in range(len(quiet))],
            "peak_sum": round(max((sum(s) for s in samples), default=0)),
            "quiet_sum": round(sum(quiet)),
        },
        "attack": probes.summary(attack_started, attack_ended),
    }


def format_trickle(outcome: dict[str, Any]) -> str:
    rss, attack = outcome["api_rss_mb"], outcome["attack"]
    return "\n".join(
        [
            f"trickle: one key's {outcome['bodies']} bodies of 20 MiB, all but 64 bytes sent, then a byte every 5 s, "
            f"{outcome['duration_s']:g} s; its answers {outcome['answers']}",
            f"  the API's processes: {rss['quiet_each']} MB quiet, peak {rss['peak_each']} MB each, "
            f"{rss['quiet_sum']} -> {rss['peak_sum']} MB in all",
            f"  meanwhile /healthz p95 {attack['healthz']['p95_s']} s; the other key's submissions "
            f"{attack['other_key_submits']['statuses']}, max {attack['other_key_submits']['max_s']} s",
        ]
    )
