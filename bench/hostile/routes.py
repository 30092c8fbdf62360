"""`bench hostile --attack redeliver / leaks`: issue 52's findings on routes any key (or anyone) may call.

redeliver: one key's job is delivered to a prompt receiver; then the key asks `POST /v1/jobs/<id>/callback` again
and again, 8 threads for `--duration` seconds (the probe: 6,000 calls in 16.5 s), while another key submits a job
with a callback every 0.5 s. Printed: how many times the first key's receiver got that job, and how long after
each of the other key's jobs ended its callback arrived.

leaks: make run's stack with two keys (one of them an admin key): what /metrics on the API's port, /v1/models and
Flower's /metrics and /healthcheck give a caller without a key, with an ordinary key, and without credentials.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from bench.hostile.attacks import _after_end, _pick, _session, _submit, keyed_stack_options
from bench.load.client import ImageStream
from bench.stack.local import LocalStack, StackOptions
from bench.stack.processes import wait_until
from bench.stack.receivers import Receiver


def redeliver(
    options: StackOptions,
    images: list[bytes],
    duration_s: float = 16.5,
    log: Callable[[str], None] = print,
    **_ignored: Any,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="hostile-"))
    options, keys = keyed_stack_options(options, workdir)
    stack = LocalStack(workdir, options).start()
    attacker_receiver, tenant_receiver = Receiver(), Receiver()
    stream = ImageStream(images)
    answers: Counter[int] = Counter()
    normal: list[str] = []
    try:
        attacker, tenant = _session(keys["attacker"]), _session(keys["tenant"])
        job = _submit(attacker, stack.url, stream.next(0), attacker_receiver.url)
        wait_until(lambda: job in attacker_receiver.arrived, 60, what="the attacker's first callback")
        warm = _submit(tenant, stack.url, stream.next(1), tenant_receiver.url)
        wait_until(lambda: warm in tenant_receiver.arrived, 60, what="the tenant's first callback")
        before = _after_end(tenant, stack.url, warm, tenant_receiver)
        first = len(attacker_receiver.calls)
        stop = threading.Event()
        lock = threading.Lock()

        def hammer() -> None:
            session = _session(keys["attacker"])
            while not stop.is_set():
                status = session.post(f"{stack.url}/v1/jobs/{job}/callback", timeout=30).status_code
                with lock:
                    answers[status] += 1

        threads = [threading.Thread(target=hammer, daemon=True) for _ in range(8)]
        for thread in threads:
            thread.start()
        log(f"8 threads asking for job {job}'s callback again for {duration_s:g} s")
        started, i = time.monotonic(), 0
        while time.monotonic() - started < duration_s:
            normal.append(_submit(tenant, stack.url, stream.next(10 + i), tenant_receiver.url))
            i += 1
            time.sleep(max(0.0, started + i * 0.5 - time.monotonic()))
        stop.set()
        for thread in threads:
            thread.join(30)
        wait_until(lambda: all(j in tenant_receiver.arrived for j in normal), 120, what="the tenant's callbacks")
        time.sleep(3.0)  # deliveries the requests queued, if any, arrive
        delays = sorted(_after_end(tenant, stack.url, j, tenant_receiver) for j in normal)
        delivered = len(attacker_receiver.calls) - first
    finally:
        attacker_receiver.stop()
        tenant_receiver.stop()
        stack.stop()
    return {
        "duration_s": duration_s,
        "requests": dict(answers),
        "deliveries_of_that_job": delivered,
        "other_key_callback_after_job_end_s": {
            "before": round(before, 3),
            "n": len(delays),
            "p50": _pick(delays, 50),
            "max": _pick(delays, 100),
        },
    }


def format_redeliver(outcome: dict[str, Any]) -> str:
    other = outcome["other_key_callback_after_job_end_s"]
    return "\n".join(
        [
            f"redeliver: {sum(outcome['requests'].values())} POST /v1/jobs/<id>/callback "
            f"in {outcome['duration_s']:g} s "
            f"({outcome['requests']}): the receiver got that job {outcome['deliveries_of_that_job']} times",
            f"  the other key's callbacks after their job ended: {other['before']} s before the attack; during it "
            f"p50 {other['p50']} s, max {other['max']} s ({other['n']} jobs)",
        ]
    )


def leaks(options: StackOptions, images: list[bytes], log: Callable[[str], None] = print, **_ignored: Any) -> dict:
    from bench.stack.local import ProcfileStack

    workdir = Path(tempfile.mkdtemp(prefix="hostile-"))
    options, keys = keyed_stack_options(options, workdir, callback_worker=False)
    auth = dict(options.extra["auth"])
    auth["api_keys"] = [*auth["api_keys"][:1], {**auth["api_keys"][1], "admin": True}]  # the tenant: an admin key
    options.extra = {**options.extra, "auth": auth}
    stack = ProcfileStack(workdir, options).start()
    seen: dict[str, Any] = {}
    try:
        attacker, admin = _session(keys["attacker"]), _session(keys["tenant"])
        anonymous = requests.Session()
        seen["api /metrics, no key"] = anonymous.get(stack.url + "/metrics", timeout=30).status_code
        seen["api /metrics, a tenant's key"] = attacker.get(stack.url + "/metrics", timeout=30).status_code
        seen["api /metrics, an admin key"] = admin.get(stack.url + "/metrics", timeout=30).status_code
        model = attacker.get(stack.url + "/v1/models", timeout=30).json()["models"][0]
        seen["/v1/models to a tenant's key"] = {k: model.get(k) for k in ("queue", "recent_jobs", "p95_ms")}
        model = admin.get(stack.url + "/v1/models", timeout=30).json()["models"][0]
        seen["/v1/models to an admin key"] = {k: model.get(k) for k in ("queue", "recent_jobs", "p95_ms")}
        flower = f"http://127.0.0.1:{stack.env['FLOWER_PORT']}"
        for path in ("/metrics", "/healthcheck", "/api/tasks"):
            seen[f"flower {path}, no credentials"] = anonymous.get(flower + path, timeout=30).status_code
    finally:
        stack.stop()
    return seen


def format_leaks(outcome: dict[str, Any]) -> str:
    return "leaks:\n" + "\n".join(f"  {what}: {answer}" for what, answer in outcome.items())
