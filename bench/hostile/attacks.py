"""`bench hostile`: attacks of issue 40's probe, run against a live local stack, and what a normal tenant saw
meanwhile. Each attack is one function (`ATTACKS` names them).

slow-callbacks: one API key's jobs call back a receiver that sends its headers, then a byte every 2 s; another
key's jobs, submitted meanwhile, call back a receiver that answers at once. It prints how long after each job
ended the normal tenant's callback arrived, and how the attacker's receiver was held (connections at once,
how long each lasted).

docs-flood: the API's CPU per call of /docs, /openapi.json and /healthz, and an authenticated poll's latency
alone and while 8 clients fetch /docs without a key.

metrics: random methods on /healthz against make run's stack; /metrics's series, size and scrape time.

`--root` runs the stack from another checkout (the figures before a change).

The callback receivers (`Tarpit`, `Receiver`: bench/stack/receivers.py) are real HTTP servers on threads of this
process.
"""

from __future__ import annotations

import hashlib
import random
import secrets
import string
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from bench.load.client import ImageStream
from bench.stack.local import LocalStack, StackOptions
from bench.stack.processes import wait_until
from bench.stack.receivers import Receiver, Tarpit

KEY_IDS = ("attacker", "tenant")


def keyed_stack_options(
    options: StackOptions, workdir: Path, callback_worker: bool = True
) -> tuple[StackOptions, dict[str, str]]:
    """`options` with two API keys whose callbacks are allowed to this machine's receivers, each key's callback
    secret in a file of `workdir`, and a callback worker as the Procfile runs it. The keys themselves, by id."""
    keys, entries = {}, []
    for key_id in KEY_IDS:
        keys[key_id] = secrets.token_urlsafe(24)
        secret = workdir / f"{key_id}.callback-secret"
        secret.write_text(secrets.token_urlsafe(32))
        entries.append(
            {
                "id": key_id,
                "sha256": hashlib.sha256(keys[key_id].encode()).hexdigest(),
                "callback_secret_file": str(secret),
            }
        )
    extra = {
        **options.extra,
        "auth": {"api_keys": entries, "rate_per_s": 0},
        "callbacks": {"allow_hosts": ["127.0.0.1"]},
    }
    options.extra, options.callback_worker = extra, callback_worker
    return options, keys


def slow_callbacks(
    options: StackOptions,
    images: list[bytes],
    attackers: int = 16,
    duration_s: float = 60.0,
    interval_s: float = 2.0,
    every_s: float = 2.0,
    log: Callable[[str], None] = print,
    **_ignored: Any,
) -> dict[str, Any]:
    """The attack of finding 1: `attackers` jobs of one key call back a tarpit that trickles a byte every
    `interval_s`; for `duration_s`, another key submits a job every `every_s` with a callback to a receiver
    that answers at once. Then the tarpit stops and the last callbacks are waited for."""
    workdir = Path(tempfile.mkdtemp(prefix="hostile-"))
    options, keys = keyed_stack_options(options, workdir)
    stack = LocalStack(workdir, options).start()
    tarpit, receiver = Tarpit("trickle", interval_s), Receiver()
    stream = ImageStream(images)
    normal: list[str] = []
    try:
        attacker = _session(keys["attacker"])
        tenant = _session(keys["tenant"])
        warm = _submit(tenant, stack.url, stream.next(0), receiver.url)  # a delivery before the attack
        wait_until(lambda: warm in receiver.arrived, 60, what="the first callback")
        log(
            f"before the attack: a callback {_after_end(tenant, stack.url, warm, receiver) * 1000:.0f} ms after "
            "its job ended"
        )
        for i in range(attackers):
            _submit(attacker, stack.url, stream.next(1 + i), tarpit.url)
        wait_until(lambda: tarpit.visits, 60, what="the attacker's first callback at the tarpit")
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < duration_s:
            normal.append(_submit(tenant, stack.url, stream.next(1000 + i), receiver.url))
            i += 1
            time.sleep(max(0.0, started + i * every_s - time.monotonic()))
        during = [job_id for job_id in normal if job_id in receiver.arrived]
        peak, visits = tarpit.gauge.peak, list(tarpit.visits)
        log(
            f"attack over after {duration_s:g} s: {len(during)} of {len(normal)} callbacks arrived meanwhile; "
            "the tarpit stops"
        )
        tarpit.stop()
        try:
            wait_until(
                lambda: all(job_id in receiver.arrived for job_id in normal),
                120,
                interval_s=0.2,
                what="the normal tenant's last callbacks",
            )
        except AssertionError:
            log("some of the normal tenant's callbacks never arrived")
        delays = sorted(
            _after_end(tenant, stack.url, job_id, receiver) for job_id in normal if job_id in receiver.arrived
        )
        held = sorted(visit.held_s for visit in visits)
    finally:
        tarpit.stop()
        receiver.stop()
        stack.stop()
    return {
        "attackers": attackers,
        "duration_s": duration_s,
        "interval_s": interval_s,
        "normal_jobs": len(normal),
        "arrived_during_attack": len(during),
        "arrived": len(delays),
        "callback_after_job_end_s": {"p50": _pick(delays, 50), "p95": _pick(delays, 95), "max": _pick(delays, 100)},
        "tarpit": {
            "connections": len(visits),
            "at_once_peak": peak,
            "held_s": {"p50": _pick(held, 50), "max": _pick(held, 100)},
            "closed_by_the_service": sum(visit.closed_by_client for visit in visits),
        },
    }


def format_slow_callbacks(outcome: dict[str, Any]) -> str:
    after, tarpit = outcome["callback_after_job_end_s"], outcome["tarpit"]
    return "\n".join(
        [
            f"slow-callbacks: {outcome['attackers']} attacker jobs calling back a receiver that trickles a byte "
            f"every {outcome['interval_s']:g} s, {outcome['duration_s']:g} s",
            f"  normal tenant: {outcome['arrived_during_attack']} of {outcome['normal_jobs']} callbacks arrived "
            f"during the attack, {outcome['arrived']} in all; after its job ended: p50 {after['p50']} s, "
            f"p95 {after['p95']} s, max {after['max']} s",
            f"  attacker's receiver: {tarpit['connections']} connections, at most {tarpit['at_once_peak']} at once, "
            f"each held p50 {tarpit['held_s']['p50']} s, max {tarpit['held_s']['max']} s; "
            f"{tarpit['closed_by_the_service']} ended by the service (the rest by the tarpit's stop)",
        ]
    )


def docs_flood(
    options: StackOptions,
    images: list[bytes],
    clients: int = 8,
    duration_s: float = 20.0,
    log: Callable[[str], None] = print,
    **_ignored: Any,
) -> dict[str, Any]:
    """Finding 6: the API's CPU per call of /docs and of /healthz (one client, one after another), then an
    authenticated poll's latency alone and while `clients` threads fetch /docs without a key."""
    workdir = Path(tempfile.mkdtemp(prefix="hostile-"))
    options, keys = keyed_stack_options(options, workdir, callback_worker=False)
    stack = LocalStack(workdir, options).start()
    try:
        tenant = _session(keys["tenant"])
        job = tenant.post(
            f"{stack.url}/v1/jobs", data=images[0], headers={"Content-Type": "image/jpeg"}, timeout=30
        ).json()["id"]
        plain = requests.Session()
        cost = {
            path: _api_cpu_ms(stack, plain, f"{stack.url}{path}", calls)
            for path, calls in (("/healthz", 1000), ("/docs", 200), ("/openapi.json", 200))
        }
        log(f"API CPU per call: {cost}")
        alone = _poll_latencies(tenant, f"{stack.url}/v1/jobs/{job}", duration_s / 2)
        stop = threading.Event()

        def fetch_docs() -> None:
            session = requests.Session()
            while not stop.is_set():
                session.get(f"{stack.url}/docs", timeout=30)

        flood = [threading.Thread(target=fetch_docs, daemon=True) for _ in range(clients)]
        for thread in flood:
            thread.start()
        try:
            flooded = _poll_latencies(tenant, f"{stack.url}/v1/jobs/{job}", duration_s / 2)
        finally:
            stop.set()
            for thread in flood:
                thread.join(30)
    finally:
        stack.stop()
    return {
        "clients": clients,
        "api_cpu_ms_per_call": cost,
        "poll_ms_alone": _quantiles(alone),
        "poll_ms_with_docs_flood": _quantiles(flooded),
    }


def format_docs_flood(outcome: dict[str, Any]) -> str:
    cost, alone, flooded = outcome["api_cpu_ms_per_call"], outcome["poll_ms_alone"], outcome["poll_ms_with_docs_flood"]
    return "\n".join(
        [
            "docs-flood: " + ", ".join(f"{path} {ms} ms" for path, ms in cost.items()) + " of the API's CPU per call",
            f"  an authenticated poll alone: p50 {alone['p50']} ms, p90 {alone['p90']} ms ({alone['n']} polls)",
            f"  with {outcome['clients']} clients fetching /docs: p50 {flooded['p50']} ms, p90 {flooded['p90']} ms "
            f"({flooded['n']} polls)",
        ]
    )


def metrics_cardinality(
    options: StackOptions,
    images: list[bytes],
    requests_sent: int = 3000,
    log: Callable[[str], None] = print,
    **_ignored: Any,
) -> dict[str, Any]:
    """Finding 5: random methods on /healthz, without a key, against make run's stack (its API in Prometheus's
    multiprocess mode, as deployed); /metrics's series, size and scrape time before and after, and the size of
    the metrics files."""
    from bench.stack.local import ProcfileStack

    stack = ProcfileStack(Path(tempfile.mkdtemp(prefix="hostile-")), options).start()
    try:
        session = requests.Session()
        before = _scrape(session, stack.url)
        rng = random.Random(5)
        for _ in range(requests_sent):
            method = "".join(rng.choice(string.ascii_uppercase) for _ in range(10))
            session.request(method, f"{stack.url}/healthz", timeout=30)
        after = _scrape(session, stack.url)
        files = sum(path.stat().st_size for path in (stack.workdir / "prometheus").glob("*.db"))
    finally:
        stack.stop()
    return {"requests": requests_sent, "before": before, "after": after, "metrics_files_bytes": files}


def format_metrics_cardinality(outcome: dict[str, Any]) -> str:
    before, after = outcome["before"], outcome["after"]
    return (
        f"metrics: {outcome['requests']} random methods on /healthz: /metrics {before['series']} -> "
        f"{after['series']} series, {before['bytes']} -> {after['bytes']} bytes, a scrape {before['ms']} -> "
        f"{after['ms']} ms (median of 5); the metrics files {outcome['metrics_files_bytes']} bytes"
    )


# Issue 52's attacks on connections and routes are bench.hostile.holds' and bench.hostile.routes'.
ATTACKS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[[dict[str, Any]], str]]] = {
    "slow-callbacks": (slow_callbacks, format_slow_callbacks),
    "docs-flood": (docs_flood, format_docs_flood),
    "metrics": (metrics_cardinality, format_metrics_cardinality),
}


def _api_cpu_ms(stack: LocalStack, session: requests.Session, url: str, calls: int) -> float:
    """The API processes' CPU per call of `url`, one call after another (the first, which may build, apart)."""
    from bench.stack.cpu import ms_per_image

    session.get(url, timeout=30)
    before = stack.cpu_scope().sample()
    for _ in range(calls):
        session.get(url, timeout=30)
    return ms_per_image(before, stack.cpu_scope().sample(), calls).get("api", 0.0)


def _poll_latencies(session: requests.Session, url: str, duration_s: float) -> list[float]:
    taken, until = [], time.monotonic() + duration_s
    while time.monotonic() < until:
        started = time.perf_counter()
        session.get(url, timeout=30).raise_for_status()
        taken.append((time.perf_counter() - started) * 1000.0)
    return sorted(taken)


def _quantiles(sorted_ms: list[float]) -> dict[str, Any]:
    return {"n": len(sorted_ms), "p50": _pick(sorted_ms, 50), "p90": _pick(sorted_ms, 90)}


def _scrape(session: requests.Session, url: str) -> dict[str, Any]:
    times, text = [], ""
    for _ in range(5):
        started = time.perf_counter()
        text = session.get(f"{url}/metrics", timeout=60).text
        times.append((time.perf_counter() - started) * 1000.0)
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {"series": len(samples), "bytes": len(text.encode()), "ms": round(sorted(times)[2], 1)}


def _session(key: str) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    return session


def _submit(session: requests.Session, url: str, image: bytes, callback_url: str) -> str:
    response = session.post(
        f"{url}/v1/jobs",
        params={"callback_url": callback_url},
        data=image,
        headers={"Content-Type": "image/jpeg"},
        timeout=30,
    )
    response.raise_for_status()
    return str(response.json()["id"])


def _after_end(session: requests.Session, url: str, job_id: str, receiver: Receiver) -> float:
    """Seconds from the job's end (its creation and its time bill's total) to its callback's arrival."""
    doc = session.get(f"{url}/v1/jobs/{job_id}", timeout=30).json()
    created = datetime.fromisoformat(doc["created_at"].replace("Z", "+00:00")).timestamp()
    return receiver.arrived[job_id] - (created + doc["timings_ms"]["total"] / 1000.0)


def _pick(values: list[float], q: float) -> float | None:
    from contract.jobs.timebill import percentile

    return round(percentile(values, q), 2) if values else None
