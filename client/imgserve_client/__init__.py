"""A Python client for the imgserve API.

    from imgserve_client import Client
    c = Client("http://localhost:8000")
    doc = c.submit("street.jpg", wait=True)            # the finished job document
    for path, doc in c.submit_many(Path("photos").glob("*.jpg"), concurrency=8):
        ...
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

# The job states that end a job (contract.jobs.TERMINAL; the client imports nothing from the service,
# and a test keeps the two equal).
TERMINAL = ("succeeded", "failed", "expired", "cancelled")
_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp",
          ".bmp": "image/bmp", ".gif": "image/gif"}


class ApiError(Exception):
    """The API answered with a problem document (or not at all)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(f"{status} {problem.get('title', '')}: {problem.get('detail', '')}".strip())
        self.status = status
        self.problem = problem


class Client:
    def __init__(self, base_url: str = "http://localhost:8000", api_key: str | None = None,
                 timeout_s: float = 30.0, pool_size: int = 16) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=pool_size))
        self.session.mount("https://", requests.adapters.HTTPAdapter(pool_maxsize=pool_size))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def submit(self, image: str | Path | bytes, wait: bool = False, wait_timeout_s: float = 120.0,
               **options: Any) -> dict[str, Any]:
        """Submit one image (a path or bytes); with wait=True, return the finished job."""
        data, content_type = _read(image)
        params = {k: str(v) for k, v in options.items() if v is not None}
        response = self.session.post(f"{self.base_url}/v1/jobs", data=data, params=params,
                                     headers={"Content-Type": content_type}, timeout=self.timeout_s)
        job = _json_or_raise(response)
        if not wait or job["status"] in TERMINAL:   # over already (a result-cache hit: the 202 has its result)
            return job
        return self.wait(job["id"], wait_timeout_s)

    def status(self, job_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        params = {"wait": wait_s} if wait_s else None
        response = self.session.get(f"{self.base_url}/v1/jobs/{job_id}", params=params,
                                    timeout=self.timeout_s + wait_s)
        return _json_or_raise(response)

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

    def submit_many(self, images: Iterable[str | Path | bytes], concurrency: int = 8,
                    **options: Any) -> Iterator[tuple[Any, dict[str, Any]]]:
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


def _json_or_raise(response: requests.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = {"title": response.reason, "detail": response.text[:200]}
    if response.status_code >= 400:
        raise ApiError(response.status_code, body)
    return body
