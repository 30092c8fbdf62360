"""Load over real HTTP, end to end: submit, then long-poll to a terminal state.

Open loop: Poisson arrivals at a target rate, whatever the service does.
Closed loop: a fixed number of clients, each sending its next request when
its last one ends. The serial baseline answers the submit itself (200 with the
finished job); the pipeline answers 202 and is long-polled.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from contract.jobs.record import TERMINAL as TERMINAL_STATUSES

TERMINAL = tuple(sorted(TERMINAL_STATUSES))


@dataclass
class Outcome:
    started: float  # monotonic seconds
    ended: float
    status: str  # a job status, or "rejected" / "error"
    reason: str | None = None  # why it did not succeed
    doc: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


class ImageStream:
    """Each request's image. By default every one is new: a corpus image with 16 bytes after its end (decoders
    stop at the end marker; the result cache does not), so a run measures misses, not the cache. With
    `repeat_share` P, a request sends, with probability P, one of the last `history` images sent (a retry, a
    product photo checked again); the first of each is computed, the later ones may hit the result cache."""

    def __init__(self, images: list[bytes], repeat_share: float = 0.0, seed: int = 0, history: int = 256) -> None:
        if not images or not 0.0 <= repeat_share < 1.0:
            raise ValueError("an ImageStream needs images and a repeat_share in [0, 1)")
        self.images, self.repeat_share = images, repeat_share
        self._rng = random.Random(seed)
        self._run = random.getrandbits(64).to_bytes(8, "big")  # another run's images are not this run's repeats
        self._sent: deque[bytes] = deque(maxlen=history)
        self._count = 0
        self._lock = threading.Lock()

    def next(self, index: int) -> bytes:
        with self._lock:
            if self._sent and self._rng.random() < self.repeat_share:
                return self._sent[self._rng.randrange(len(self._sent))]
            self._count += 1
            image = self.images[index % len(self.images)] + self._run + self._count.to_bytes(8, "big")
            self._sent.append(image)
            return image


def as_stream(images: list[bytes] | ImageStream) -> ImageStream:
    return images if isinstance(images, ImageStream) else ImageStream(images)


def session_for(concurrency: int) -> requests.Session:
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=max(10, concurrency))
    session.mount("http://", adapter)
    return session


UPLOADS = ("raw", "multipart")


CALLS = ("two", "one")  # submit then long-poll; or one call (POST /v1/jobs?wait=ONE_CALL_WAIT_S)
ONE_CALL_WAIT_S = 30


def request_once(
    session: requests.Session,
    url: str,
    image: bytes,
    give_up_s: float = 90.0,
    model: str | None = None,
    upload: str = "raw",
    one_call: bool = False,
) -> Outcome:
    """Submit (to `model`, a name or name:version, when given) as a raw body or a multipart form (`curl -F`),
    then long-poll to the end; with `one_call`, the submission itself waits for the end (`?wait=`), as a
    synchronous peer's one POST does (a long-poll follows only if it did not end within the wait)."""
    started = time.monotonic()
    params: dict[str, str] = {
        **({"model": model} if model else {}),
        **({"wait": str(ONE_CALL_WAIT_S)} if one_call else {}),
    }
    try:
        if upload == "multipart":
            response = session.post(
                f"{url}/v1/jobs",
                files={"image": ("image.jpg", image, "image/jpeg")},
                data={"model": model} if model else None,
                timeout=90,
                params={"wait": str(ONE_CALL_WAIT_S)} if one_call else None,
            )
        else:
            response = session.post(
                f"{url}/v1/jobs", data=image, headers={"Content-Type": "image/jpeg"}, timeout=90, params=params or None
            )
        if response.status_code == 200:
            return _outcome(started, response.json())
        if response.status_code != 202:
            return Outcome(started, time.monotonic(), "rejected", f"http_{response.status_code}")
        accepted = response.json()
        if accepted["status"] in TERMINAL:  # a result-cache hit: the 202 carries the answer
            return _outcome(started, accepted)
        job_url = f"{url}/v1/jobs/{accepted['id']}"
        while time.monotonic() - started < give_up_s:
            doc = session.get(job_url, params={"wait": 10}, timeout=40).json()
            if doc["status"] in TERMINAL:
                return _outcome(started, doc)
        return Outcome(started, time.monotonic(), "error", "gave_up")
    except requests.RequestException as exc:
        return Outcome(started, time.monotonic(), "error", type(exc).__name__)


def _outcome(started: float, doc: dict[str, Any]) -> Outcome:
    error = doc.get("error") or {}
    return Outcome(started, time.monotonic(), doc["status"], error.get("code"), doc)


def poisson_arrivals(qps: float, duration_s: float, seed: int = 0) -> list[float]:
    """Arrival times (s from the start) of a Poisson process at `qps` over `duration_s`."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(qps)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(qps)
    return arrivals


def open_loop(
    url: str,
    images: list[bytes] | ImageStream,
    qps: float,
    duration_s: float,
    seed: int = 0,
    max_in_flight: int = 512,
    tick: Callable[[], None] = lambda: None,
    model: str | None = None,
    upload: str = "raw",
    one_call: bool = False,
) -> list[Outcome]:
    """Poisson arrivals at `qps` for `duration_s`; waits for every request to end."""
    arrivals = poisson_arrivals(qps, duration_s, seed)
    stream = as_stream(images)
    session = session_for(max_in_flight)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def fire(index: int) -> None:
        outcome = request_once(session, url, stream.next(index), model=model, upload=upload, one_call=one_call)
        with lock:
            outcomes.append(outcome)
        tick()

    with ThreadPoolExecutor(max_in_flight) as pool:
        begin = time.monotonic()
        for i, at in enumerate(arrivals):
            delay = begin + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(fire, i)
    return outcomes


def closed_loop(
    url: str,
    images: list[bytes] | ImageStream,
    concurrency: int,
    duration_s: float,
    tick: Callable[[], None] = lambda: None,
    model: str | None = None,
    upload: str = "raw",
    one_call: bool = False,
    send: Callable[[requests.Session, str, bytes], Outcome] | None = None,
) -> list[Outcome]:
    """`concurrency` clients back to back for `duration_s`; each request by `send` (session, url, image) when
    given (another server's API: bench.load.peer), else as request_once sends it."""
    stream = as_stream(images)
    session = session_for(concurrency)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def client(offset: int) -> None:
        i = offset
        while time.monotonic() < stop_at:
            image = stream.next(i)
            outcome = (
                send(session, url, image)
                if send is not None
                else request_once(session, url, image, model=model, upload=upload, one_call=one_call)
            )
            with lock:
                outcomes.append(outcome)
            tick()
            i += concurrency

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def input_size(url: str, model: str | None = None, default: int = 320) -> int:
    """The input size of the model a run loads (`model`, else the deployment's default), from /v1/models."""
    try:
        listed = requests.get(f"{url}/v1/models", timeout=5).json()["models"]
    except (requests.RequestException, ValueError, KeyError):
        return default
    name, _, version = (model or "").partition(":")
    chosen = (
        [m for m in listed if m.get("name") == name and (not version or m.get("version") == version)]
        if model
        else [m for m in listed if m.get("default")]
    )
    return int((chosen or listed or [{}])[0].get("input_size", default))


def first_polls(url: str, job_ids: list[str], limit: int = 200) -> tuple[list[float], list[float]]:
    """One plain read (`GET /v1/jobs/<id>`, no wait) of each job, one after another: milliseconds as this client
    saw them over loopback, and as the API says it took (its `Server-Timing: app;dur=`; none from an API that
    does not say). For result-cache hits: their first poll."""
    session = session_for(1)
    seen, at_api = [], []
    for job_id in job_ids[:limit]:
        started = time.perf_counter()
        response = session.get(f"{url}/v1/jobs/{job_id}", timeout=10)
        seen.append((time.perf_counter() - started) * 1000.0)
        response.raise_for_status()
        if (api_ms := server_timing_ms(response.headers.get("Server-Timing", ""))) is not None:
            at_api.append(api_ms)
    return seen, at_api


def server_timing_ms(header: str, metric: str = "app") -> float | None:
    """The `dur` of `metric` in a Server-Timing header (`app;dur=1.23`), or None."""
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        if name != metric:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur":
                try:
                    return float(value.strip().strip('"'))
                except ValueError:
                    return None
    return None


def gpu_counters(url: str) -> dict[str, float] | None:
    """Device seconds and wall time now, to turn into a busy % over a run."""
    try:
        stats = requests.get(f"{url}/v1/stats", timeout=5).json()
    except (requests.RequestException, ValueError):
        return None
    gpu = stats.get("gpu", {})
    workers = stats.get("gpu_workers", [])
    simulated = gpu.get("simulated", any(w.get("simulated") for w in workers))
    return {
        "device_seconds": float(gpu.get("device_seconds_total", 0.0)),
        "wall": time.monotonic(),
        "workers": max(1, int(gpu.get("workers", 1))),
        "simulated": bool(simulated),
    }
