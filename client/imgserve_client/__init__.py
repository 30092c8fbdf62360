"""A Python client for the imgserve API.

from imgserve_client import Client
c = Client("http://localhost:8000")
doc = c.submit("samples/shapes-36.jpg", wait=True)   # the finished job document (one call)
for path, doc in c.submit_many(Path("photos").glob("*.jpg"), concurrency=8):
    ...

A request refused as busy (429, 503) is sent again after its Retry-After, within Client(retries=,
retry_wait_s=); what is still refused raises ApiError (status, problem, headers, retry_after).
The server is not trusted: an answer longer than Client(max_answer_bytes=) raises AnswerTooLarge, and one that has
not arrived whole within the call's time (timeout_s, plus its wait) raises AnswerTooSlow, however it trickles.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import requests
import urllib3
from requests.structures import CaseInsensitiveDict

from imgserve_client.answers import MAX_ANSWER_BYTES, AnswerTooLarge, AnswerTooSlow, WatchedAdapter, bounded, printable

__all__ = ["AnswerTooLarge", "AnswerTooSlow", "ApiError", "Client", "parse_retry_after", "printable"]

GMT = timezone.utc  # noqa: UP017 (datetime.UTC is Python 3.11's; the client runs on 3.10)
# The job states that end a job (contract.jobs.TERMINAL; the client imports nothing from the service,
# and a test keeps the two equal).
TERMINAL = ("succeeded", "failed", "expired", "cancelled")
# How long a submission with wait=True holds its one call (the API's default api.max_wait_s is 30).
ONE_CALL_WAIT_S = 20.0
# A refusal that means "not now" (too much waiting, the store full, the server busy): nothing was taken, so the
# same request is sent again after its Retry-After.
RETRIED_STATUSES = (429, 503)
RETRIES = 20  # a request refused this many times more is given up (Client(retries=0): never retried)
RETRY_WAIT_S = 120.0  # nor retried once its waits would pass this in all
NO_RETRY_AFTER_S = 1.0  # the wait when a refusal says no Retry-After (doubled at each refusal after)
_TYPES = {
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".png": "image/png",
    ".webp": "image/webp",
    ".bmp": "image/bmp",
    ".gif": "image/gif",
}


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds a Retry-After header asks to wait (RFC 9110: delta-seconds, or an HTTP-date, from `now`); None
    when absent or unreadable. A date already past is 0."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT; a date without a zone is read as that
        when = when.replace(tzinfo=GMT)
    return max(0.0, (when - (now or datetime.now(GMT))).total_seconds())


class ApiError(Exception):
    """The API answered with a problem document (or not at all): its `status`, the `problem` document, the
    response's `headers`, and `retry_after` (seconds, from Retry-After; None without one)."""

    def __init__(self, status: int, problem: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        # The message is printed (the CLI): what the server wrote in it is escaped; `problem` keeps it as sent.
        title, detail = printable(problem.get("title", "")), printable(problem.get("detail", ""))
        super().__init__(f"{status} {title}: {detail}".strip())
        self.status = status
        self.problem = problem
        self.headers: CaseInsensitiveDict[str] = CaseInsensitiveDict(headers or {})
        self.retry_after = parse_retry_after(self.headers.get("Retry-After"))


class Client:
    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        api_key: str | None = None,
        timeout_s: float = 30.0,
        pool_size: int = 16,
        retries: int = RETRIES,
        retry_wait_s: float = RETRY_WAIT_S,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        """`retries`: how often a request refused with 429 or 503 is sent again, each after its Retry-After, as
        long as the waits and the refused exchanges stay within `retry_wait_s` in all (0: a refusal is raised at
        once; a call so ends within `retry_wait_s` plus one exchange's `timeout_s`). `timeout_s`: the
        longest one request may take, all of it (a long-poll adds its wait); `max_answer_bytes`: the longest
        answer read."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.retries, self.retry_wait_s = max(0, retries), max(0.0, retry_wait_s)
        self.retried = 0  # refusals retried by this client so far, every request together
        self._retried_lock = threading.Lock()
        self._sleep: Callable[[float], None] = time.sleep
        self._answered = False  # the API has answered this client once: a refused connection then is a restart
        self.session = requests.Session()
        self.session.mount("http://", WatchedAdapter(pool_maxsize=pool_size))
        self.session.mount("https://", WatchedAdapter(pool_maxsize=pool_size))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self._longest_wait_s = 25.0  # lowered when the deployment's api.max_wait_s is shorter (_waiting)

    def submit(
        self, image: str | Path | bytes, wait: bool = False, wait_timeout_s: float = 120.0, **options: Any
    ) -> dict[str, Any]:
        """Submit one image (a path or bytes); with wait=True, return the finished job: in one call
        (`POST /v1/jobs?wait=S`) when it ends within ONE_CALL_WAIT_S, else by long-polling for the rest."""
        data, content_type = _read(image)
        params = {k: str(v) for k, v in options.items() if v is not None}
        started = time.monotonic()
        job = self._waiting(
            lambda wait_s: self._post_job(data, content_type, params, wait_s),
            min(ONE_CALL_WAIT_S, wait_timeout_s) if wait else 0.0,
        )
        if not wait or job["status"] in TERMINAL:  # over already (one call, or a result-cache hit)
            return job
        return self.wait(job["id"], max(0.0, wait_timeout_s - (time.monotonic() - started)))

    def _post_job(self, data: bytes, content_type: str, params: dict[str, str], wait_s: float) -> dict[str, Any]:
        response = self._request(
            "POST",
            "/v1/jobs",
            data=data,
            params={**params, "wait": f"{wait_s:g}"} if wait_s else params,
            headers={"Content-Type": content_type},
            timeout=self.timeout_s + wait_s,
        )
        return _json_or_raise(response)

    def status(self, job_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        def read(wait: float) -> dict[str, Any]:
            response = self._request(
                "GET",
                f"/v1/jobs/{job_id}",
                params={"wait": f"{wait:g}"} if wait else None,
                timeout=self.timeout_s + wait,
            )
            return _json_or_raise(response)

        return self._waiting(read, wait_s)

    def _waiting(self, call: Callable[[float], dict[str, Any]], wanted_s: float) -> dict[str, Any]:
        """call(wait) with the wait wanted, or the longest this deployment takes (its api.max_wait_s, learnt from
        its 400s and remembered: a 400 on `wait` comes before a body is read, so nothing was made)."""
        while True:
            wait_s = min(wanted_s, self._longest_wait_s)
            try:
                return call(wait_s)
            except ApiError as exc:
                if wait_s <= 0 or not _names_param(exc, "wait"):
                    raise
                self._longest_wait_s = 0.0 if wait_s <= 1.0 else max(1.0, wait_s / 4)

    def wait(self, job_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """Long-poll until the job ends (or timeout_s passes: then its current state)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            doc = self.status(job_id, wait_s=max(0.0, min(25.0, remaining)))
            if doc["status"] in TERMINAL or remaining <= 0:
                return doc

    def cancel(self, job_id: str) -> dict[str, Any]:
        return _json_or_raise(self._request("DELETE", f"/v1/jobs/{job_id}", timeout=self.timeout_s))

    def models(self) -> list[dict[str, Any]]:
        return _json_or_raise(self._request("GET", "/v1/models", timeout=self.timeout_s))["models"]

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One request, sent again while it is refused with 429 or 503 (it was not taken: a submission too is
        safe to send again), each time after the wait its Retry-After asks, within this client's bounds; the
        last answer otherwise. Sent again too when its connection was refused once this client has had an answer
        from the API (it is restarting: nothing was sent); a first refused connection is a wrong URL or an API
        not running, said at once. A request that may have reached the API (a timeout, a connection lost) is
        never sent again here: a submission may have been taken."""
        # `spent`: the waits and the refused exchanges themselves, so a server that holds each refusal before it
        # answers cannot stretch the call past the retries' bound (the waits alone were bounded before).
        spent, attempt = 0.0, 0
        while True:
            sent = time.monotonic()
            try:
                response = bounded(
                    self.session, method, f"{self.base_url}{path}", kwargs["timeout"], self.max_answer_bytes, **kwargs
                )
            except requests.ConnectionError as exc:
                if not (self._answered and _never_sent(exc)):
                    raise
                spent += time.monotonic() - sent
                wait = self._retry_wait(attempt, None, spent)
                if wait is None:
                    raise
            else:
                self._answered = True
                if response.status_code not in RETRIED_STATUSES:
                    return response
                spent += time.monotonic() - sent
                wait = self._retry_wait(attempt, parse_retry_after(response.headers.get("Retry-After")), spent)
                if wait is None:
                    return response
                response.close()
            with self._retried_lock:
                self.retried += 1
            self._sleep(wait)
            spent, attempt = spent + wait, attempt + 1

    def _retry_wait(self, attempt: int, asked: float | None, spent: float) -> float | None:
        """How long to wait before sending a refused request again (`asked`: its Retry-After; without one, a wait
        doubling from NO_RETRY_AFTER_S), or None when the retries' count, or the time `spent` on the call's refused
        exchanges and waits with this wait added, would be past its bound."""
        if attempt >= self.retries:
            return None
        wait = NO_RETRY_AFTER_S * 2**attempt if asked is None else asked
        wait += random.uniform(0.0, min(1.0, wait / 10))  # refused together, not all back in the same instant
        return None if spent + wait > self.retry_wait_s else wait

    def submit_many(
        self, images: Iterable[str | Path | bytes], concurrency: int = 8, **options: Any
    ) -> Iterator[tuple[Any, dict[str, Any]]]:
        """(image, finished job or {"status": "error", ...}) for each image, in order, at most
        `concurrency` in flight."""

        def one(image):
            try:
                return image, self.submit(image, wait=True, **options)
            except (ApiError, requests.RequestException, OSError) as exc:
                return image, {"status": "error", "error": {"code": type(exc).__name__, "message": str(exc)}}

        with ThreadPoolExecutor(concurrency) as pool:
            yield from pool.map(one, images)


def _read(image: str | Path | bytes) -> tuple[bytes, str]:
    if isinstance(image, (bytes, bytearray)):
        return bytes(image), "application/octet-stream"
    path = Path(image)
    return path.read_bytes(), _TYPES.get(path.suffix.lower(), "application/octet-stream")


def _never_sent(error: requests.ConnectionError) -> bool:
    """The connection was never made (refused, no route): the request reached nothing."""
    reason = getattr(error.args[0], "reason", None) if error.args else None
    return isinstance(reason, urllib3.exceptions.NewConnectionError)


def _names_param(error: ApiError, name: str) -> bool:
    """A 400 whose problem names this parameter as the one at fault."""
    return error.status == 400 and any(p.get("name") == name for p in error.problem.get("invalid_params") or ())


def _json_or_raise(response: requests.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        body = None
    if not isinstance(body, dict):  # what no API answer is: said as an error, not a traceback further on
        body = {"title": response.reason or "not an API answer", "detail": response.text[:200]}
        if response.status_code < 400:
            raise ApiError(response.status_code, {**body, "title": "not an API answer"}, response.headers)
    if response.status_code >= 400:
        raise ApiError(response.status_code, body, response.headers)
    return body
