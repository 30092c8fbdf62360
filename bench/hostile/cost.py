"""`bench hostile --attack cost`: issue 59's finding 4. One key keeps `--in-flight` expensive PNGs (16-bit RGBA,
Adam7, 8192x8192: bench.hostile.files.png_rgba16_adam7) in flight for the attack's duration, each sent again as
soon as the last ended (or, refused, after its Retry-After), while another key submits photos at `--qps`.
Fairness between keys was per task: each such file held a CPU child for seconds, and the other key's photos
waited behind them. What the normal tenant saw is bench.hostile.images' (its queue_cpu, its refusals)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import requests

from bench.load.client import TERMINAL


class KeepInFlight:
    """The attacker: `in_flight` threads, each submitting `data` and following its job to its end, again and
    again until `duration_s` after it starts. A `more_attacks` entry of bench.hostile.images.run_hostile."""

    __name__ = "keep in flight"

    def __init__(self, data: bytes, media_type: str, in_flight: int, duration_s: float) -> None:
        self.data, self.media_type, self.in_flight, self.duration_s = data, media_type, in_flight, duration_s
        self.outcomes: Counter[str] = Counter()
        self.ended_after_s: list[float] = []
        self.refusals: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __call__(self, url: str, headers: dict[str, str]) -> list[str]:
        until = time.monotonic() + self.duration_s
        headers = {**headers, "Content-Type": self.media_type}
        self._threads = [
            threading.Thread(target=self._keep, args=(url, headers, until), daemon=True) for _ in range(self.in_flight)
        ]
        for thread in self._threads:
            thread.start()
        return []  # followed here, not by run_hostile

    def join(self, timeout_s: float = 120.0) -> None:
        for thread in self._threads:
            thread.join(timeout_s)

    def _keep(self, url: str, headers: dict[str, str], until: float) -> None:
        session = requests.Session()
        while time.monotonic() < until:
            sent_at = time.monotonic()
            try:
                response = session.post(f"{url}/v1/jobs", data=self.data, headers=headers, timeout=60)
            except requests.RequestException as exc:
                self._count(f"error {type(exc).__name__}")
                continue
            if response.status_code != 202:
                with self._lock:
                    self.refusals[f"{response.status_code} {_problem_type(response)}"] += 1
                time.sleep(min(5.0, max(0.2, float(response.headers.get("Retry-After") or 1))))
                continue
            job_id = response.json()["id"]
            while time.monotonic() < until + 120:
                try:
                    doc = session.get(
                        f"{url}/v1/jobs/{job_id}", params={"wait": 10}, headers=headers, timeout=40
                    ).json()
                except requests.RequestException:
                    continue
                if doc["status"] in TERMINAL:
                    code = (doc.get("error") or {}).get("code")
                    self._count(f"{doc['status']} {code or ''}".strip(), time.monotonic() - sent_at)
                    break

    def _count(self, outcome: str, after_s: float | None = None) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            if after_s is not None:
                self.ended_after_s.append(after_s)

    def tally(self) -> dict[str, Any]:
        ended = sorted(self.ended_after_s)
        return {
            "in_flight": self.in_flight,
            "outcomes": dict(self.outcomes),
            "refusals": dict(self.refusals),
            "ended_after_s": {"p50": ended[len(ended) // 2], "max": ended[-1]} if ended else {},
        }


def _problem_type(response: requests.Response) -> str:
    try:
        return str(response.json().get("type", "")).rsplit("/", 1)[-1]
    except ValueError:
        return ""


def markdown(outcome: dict[str, Any]) -> str:
    attacker = outcome["attacker"]
    ended = attacker["ended_after_s"]
    lines = [
        f"attacker: {attacker['in_flight']} expensive PNGs kept in flight; ended: "
        + (", ".join(f"{k} x{v}" for k, v in attacker["outcomes"].items()) or "none")
        + (f" (after p50 {ended['p50']:.1f} s, max {ended['max']:.1f} s)" if ended else "")
        + "; refused: "
        + (", ".join(f"{k} x{v}" for k, v in attacker["refusals"].items()) or "none"),
    ]
    return "\n".join(lines)
