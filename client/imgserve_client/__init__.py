"""A Python client for the imgserve API.

from imgserve_client import Client
c = Client("http://localhost:8000")
doc = c.submit("samples/shapes-36.jpg", wait=True)   # the finished job document (one call)
for path, doc in c.submit_many(Path("photos").glob("*.jpg"), concurrency=8):
    ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

# The job states that end a job (contract.jobs.TERMINAL; the client imports nothing from the service,
# and a test keeps the two equal).
TERMINAL = ("succeeded", "failed", "expired", "cancelled")
# How long a submission with wait=True holds its one call (the API's default api.max_wait_s is 30).
ONE_CALL_WAIT_S = 20.0
_TYPES = {
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".png": "image/png",
    ".webp": "image/webp",
    ".bmp": "image/bmp",
    ".gif": "image/gif",
}


class ApiError(Exception):
    """The API answered with a problem document (or not at all)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(f"{status} {problem.get('title', '')}: {problem.get('detail', '')}".strip())
        self.status = status
        self.problem = problem


class Client:
    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        api_key: str | None = None,
        timeout_s: float = 30.0,
        pool_size: int = 16,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=pool_size))
        self.session.mount("https://", requests.adapters.HTTPAdapter(pool_maxsize=pool_size))
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
        response = self.session.post(
            f"{self.base_url}/v1/jobs",
            data=data,
            params={**params, "wait": f"{wait_s:g}"} if wait_s else params,
            headers={"Content-Type": content_type},
            timeout=self.timeout_s + wait_s,
        )
        return _json_or_raise(response)

    def status(self, job_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        def read(wait: float) -> dict[str, Any]:
            response = self.session.get(
                f"{self.base_url}/v1/jobs/{job_id}",
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
        return _json_or_raise(self.session.delete(f"{self.base_url}/v1/jobs/{job_id}", timeout=self.timeout_s))

    def models(self) -> list[dict[str, Any]]:
        return _json_or_raise(self.session.get(f"{self.base_url}/v1/models", timeout=self.timeout_s))["models"]

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


def _names_param(error: ApiError, name: str) -> bool:
    """A 400 whose problem names this parameter as the one at fault."""
    return error.status == 400 and any(p.get("name") == name for p in error.problem.get("invalid_params") or ())


def _json_or_raise(response: requests.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = {"title": response.reason, "detail": response.text[:200]}
    if response.status_code >= 400:
        raise ApiError(response.status_code, body)
    return body
