"""A name server that never answers, and the API resolving `callback_url` hosts through it (issue 59, finding 1):
what `/healthz` and another key's submission see while one key's callback submissions are stuck resolving.

    .venv/bin/python -m bench.hostile.dns --stuck 4 --duration 20                 # this checkout
    .venv/bin/python -m bench.hostile.dns --stuck 4 --duration 20 --root /tmp/base  # an older one (before)

Needs root (bench.stack.hosts). Everything runs in a network namespace made for it: the API as users run it
(gunicorn, configs/gunicorn.conf.py, the gevent worker, one process) and its own redis-server, on 127.0.0.1
inside; `ip netns exec` mounts /etc/netns/<namespace>/resolv.conf over /etc/resolv.conf, which names this
machine's end of the namespace's link as the only name server. There a UDP socket of this process (`SilentDns`)
reads every query and answers none: glibc's resolver waits out its timeouts and retries (5 s, twice: ~10 s a
lookup). Requests go to the API's address in the namespace; callbacks are never posted (no callback worker
runs, and the only host allowed is 127.0.0.1:9 inside the namespace). The namespace, its link, its processes
and /etc/netns/<namespace> are removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from bench.stack.hosts import Host, Network, check_can_make_hosts
from bench.stack.processes import (
    REPO_ROOT,
    ManagedProcess,
    api_argv,
    wait_until,
)

NETNS_ETC = Path("/etc/netns")
API_PORT = 8080  # inside the namespace: its own port space
KEY_IDS = ("slow", "other")


class SilentDns:
    """A UDP socket on port 53 that reads queries and never answers; `queries` counts them, `names` holds the
    names asked about."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.2)
        self.queries = 0
        self.names: set[str] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._read, name="silent-dns", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stopping.is_set():
            try:
                packet, _ = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.names.add(_question_name(packet))
            self.queries += 1

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self.sock.close()


def _question_name(packet: bytes) -> str:
    """The name a DNS query asks about (its first question's labels, after the 12-byte header)."""
    labels, at = [], 12
    while at < len(packet) and packet[at]:
        length = packet[at]
        labels.append(packet[at + 1 : at + 1 + length].decode("ascii", "replace"))
        at += 1 + length
    return ".".join(labels).lower()


@dataclass
class DnsRig:
    host: Host
    api: ManagedProcess
    dns: SilentDns
    keys: dict[str, str]  # the API keys, by id
    sessions: dict[str, requests.Session] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{API_PORT}"

    def session(self, key_id: str) -> requests.Session:
        if key_id not in self.sessions:
            session = requests.Session()
            session.trust_env = False  # no proxy from the environment: the namespace is reached directly
            session.headers["Authorization"] = f"Bearer {self.keys[key_id]}"
            self.sessions[key_id] = session
        return self.sessions[key_id]

    def submit(self, key_id: str, callback_url: str | None, timeout_s: float = 30.0) -> tuple[int, float, Any]:
        """(status, seconds, the answer's JSON) of one submission of a tiny image; status 0: no answer within
        `timeout_s` (a client's usual 30 s)."""
        params = {"callback_url": callback_url} if callback_url else {}
        started = time.monotonic()
        try:
            response = self.session(key_id).post(
                self.url + "/v1/jobs",
                params=params,
                data=TINY_JPEG,
                timeout=timeout_s,
                headers={"Content-Type": "image/jpeg"},
            )
        except requests.Timeout:
            return 0, time.monotonic() - started, {"_headers": {}}
        return response.status_code, time.monotonic() - started, _json(response) | {"_headers": dict(response.headers)}

    def healthz(self, timeout_s: float = 30.0) -> float:
        """Seconds /healthz took to answer 200 (`timeout_s` when it did not answer within it)."""
        started = time.monotonic()
        try:
            response = self.session("other").get(self.url + "/healthz", timeout=timeout_s)
        except requests.Timeout:
            return timeout_s
        response.raise_for_status()
        return time.monotonic() - started


def _json(response: requests.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"_text": response.text[:200]}
    return body if isinstance(body, dict) else {"_body": body}


def _tiny_jpeg() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(buffer, "JPEG")
    return buffer.getvalue()


TINY_JPEG = _tiny_jpeg()


def sweep_netns_files() -> None:
    """/etc/netns/imgs-* left by a run that was killed, whose namespace is gone."""
    if not NETNS_ETC.is_dir():
        return
    live = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    for entry in NETNS_ETC.glob("imgs-*"):
        if entry.name not in live:
            shutil.rmtree(entry, ignore_errors=True)


@contextmanager
def silent_dns_api(workdir: Path, root: Path = REPO_ROOT, callbacks: dict[str, Any] | None = None) -> Iterator[DnsRig]:
    """The API (gunicorn, gevent, one process; from the checkout `root`) in a namespace whose only name server
    never answers (see the module's note). `callbacks`: more of the callbacks section (this checkout's settings)."""
    check_can_make_hosts()
    sweep_netns_files()
    keys = {key_id: secrets.token_urlsafe(24) for key_id in KEY_IDS}
    entries = []
    for key_id, key in keys.items():
        secret = workdir / f"{key_id}.callback-secret"
        secret.write_text(secrets.token_urlsafe(32))
        entries.append(
            {"id": key_id, "sha256": hashlib.sha256(key.encode()).hexdigest(), "callback_secret_file": str(secret)}
        )
    config = {
        "redis_url": "redis://127.0.0.1:6379/0",  # the namespace's own redis-server
        "namespace": "dns59",
        "auth": {"api_keys": entries},
        "callbacks": {"allow_hosts": ["127.0.0.1:9"], **(callbacks or {})},  # inside the namespace: nothing there
        "cache": {"enabled": False},
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    with Network.create() as net:
        host = net.add_host("api")
        etc = NETNS_ETC / host.namespace
        dns = SilentDns(net.gateway)
        try:
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text(f"nameserver {net.gateway}\n")  # glibc's defaults: 5 s, 2 attempts
            env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "IMGSERVE_REDIS_URL")}
            env.update(
                {
                    "IMGSERVE_CONFIG": str(workdir / "config.yaml"),
                    "IMGSERVE_API__BIND": f"{host.address}:{API_PORT}",
                    "IMGSERVE_API__WORKERS": "1",
                    "PYTHONUNBUFFERED": "1",
                }
            )
            redis_argv = ["redis-server", "--port", "6379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            host.spawn("redis", redis_argv, env, workdir)
            api = host.spawn("gunicorn-api", api_argv(access_log=False), env, workdir, root=root)
            rig = DnsRig(host, api, dns, keys)
            wait_until(lambda: _answers(rig) or not api.alive(), 90, 0.2, what="the API in the namespace")
            assert api.alive(), api.log_tail()
            yield rig
        finally:
            dns.stop()
            shutil.rmtree(etc, ignore_errors=True)


def _answers(rig: DnsRig) -> bool:
    try:
        rig.healthz(timeout_s=2)
        return True
    except requests.RequestException:
        return False


def stuck_lookups(rig: DnsRig, stuck: int, duration_s: float, probe_every_s: float = 0.25) -> dict[str, Any]:
    """The slow key keeps `stuck` submissions in flight for `duration_s` (each with a callback_url whose host only
    the silent name server is asked about; each answered one sent again at once). Meanwhile, every
    `probe_every_s`, a /healthz and one of the other key's submissions (alternately without a callback and with
    the allowed literal 127.0.0.1:9), each on a thread of its own so that a stalled API cannot slow the probing
    down; timed until every request has its answer."""
    tag = secrets.token_hex(3)
    baseline = sorted(rig.healthz() for _ in range(20))
    answers: list[tuple[int, float, Any]] = []
    healthz: list[float] = []
    other: list[tuple[int, float]] = []
    queries_before = rig.dns.queries
    ends = time.monotonic() + duration_s
    counter = iter(range(1_000_000))

    def attacker() -> None:
        while time.monotonic() < ends:
            answers.append(rig.submit("slow", f"http://hook-{next(counter)}.{tag}.example/hook"))
            if answers[-1][0] == 429:
                time.sleep(0.1)  # refused at once: sent again soon, not in a loop that would take a core here

    def probe(n: int) -> None:
        healthz.append(rig.healthz())
        status, taken, _ = rig.submit("other", None if n % 2 else "http://127.0.0.1:9/hook")
        other.append((status, taken))

    attackers = [threading.Thread(target=attacker, daemon=True) for _ in range(stuck)]
    for thread in attackers:
        thread.start()
    wait_until(lambda: rig.dns.queries > queries_before, 30, what="the first query at the silent name server")
    probes: list[threading.Thread] = []
    while time.monotonic() < ends:
        probes.append(threading.Thread(target=probe, args=(len(probes),), daemon=True))
        probes[-1].start()
        time.sleep(probe_every_s)
    for thread in (*attackers, *probes):
        thread.join()
    by_status: dict[str, Any] = {}
    for status in sorted({status for status, _, _ in answers}):
        mine = [(taken, body) for code, taken, body in answers if code == status]
        by_status[str(status)] = {
            **_quantiles(sorted(taken for taken, _ in mine)),
            "detail": mine[0][1].get("detail", "")[:100],
            "retry_after": mine[0][1]["_headers"].get("Retry-After"),
        }
    return {
        "stuck": stuck,
        "duration_s": duration_s,
        "healthz_alone_ms": _quantiles(baseline),
        "healthz_ms": _quantiles(sorted(healthz)),
        "other_submit_ms": _quantiles(sorted(taken for _, taken in other)),
        "other_statuses": sorted({status for status, _ in other}),  # 0: no answer within 30 s
        "healthz_timed_out": sum(taken >= 30.0 for taken in healthz),
        "slow_key_answers": by_status,
        "queries": rig.dns.queries - queries_before,
    }


def _quantiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    pick = lambda q: round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)  # noqa: E731
    return {"n": len(values), "p50": pick(0.5), "p95": pick(0.95), "max": round(values[-1] * 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stuck", type=int, default=4, help="the slow key's submissions stuck resolving at once")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds the slow key keeps them in flight")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the checkout the API runs from")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hostile-dns-") as workdir:
        with silent_dns_api(Path(workdir), args.root.resolve()) as rig:
            print(json.dumps(stuck_lookups(rig, args.stuck, args.duration)), flush=True)


if __name__ == "__main__":
    main()
