"""`bench hostile --attack padding`: issue 70's finding 3. One key floods a small JPEG padded with 0-4 MiB of zeros
after its end (a random length each, `--attackers` threads), while another key submits a photo every 0.5 s; the
other key's submissions are counted alone first, then beside the flood. A key's share of the backlog was a job count,
not bytes: the padded uploads filled the model's byte budget and the other key was refused with it."""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests

from bench.hostile.attacks import keyed_stack_options
from bench.hostile.cost import _problem_type
from bench.stack.local import LocalStack, StackOptions

MAX_PADDING = 4 * 1024 * 1024


def small_jpeg() -> bytes:
    """A 320x240 JPEG of a few KB: the image the padding follows."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (320, 240), (40, 120, 200)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def padding(
    options: StackOptions,
    images: list[bytes],
    attackers: int = 8,
    duration_s: float = 40.0,
    log: Any = print,
    **_ignored: Any,
) -> dict[str, Any]:
    """The flood of padded uploads from one key, and the other key's submissions alone and beside it."""
    workdir = Path(tempfile.mkdtemp(prefix="hostile-padding-"))
    options, keys = keyed_stack_options(options, workdir, callback_worker=False)
    stack = LocalStack(workdir, options).start()
    small = small_jpeg()
    stop = threading.Event()
    flood: Counter[str] = Counter()
    lock = threading.Lock()

    def attack(seed: int) -> None:
        rng, session = random.Random(seed), requests.Session()
        headers = {"Authorization": f"Bearer {keys['attacker']}", "Content-Type": "image/jpeg"}
        while not stop.is_set():
            data = small + bytes(rng.randrange(MAX_PADDING))
            try:
                response = session.post(f"{stack.url}/v1/jobs", data=data, headers=headers, timeout=60)
                outcome = f"{response.status_code} {_problem_type(response)}".strip()
            except requests.RequestException as exc:
                outcome = f"error {type(exc).__name__}"
            with lock:
                flood[outcome] += 1

    try:
        alone = _tenant(stack.url, keys["tenant"], images, 10)
        threads = [threading.Thread(target=attack, args=(seed,), daemon=True) for seed in range(attackers)]
        for thread in threads:
            thread.start()
        log(f"{attackers} threads of padded uploads for {duration_s:g} s")
        time.sleep(min(5.0, duration_s / 4))  # the flood fills what it can first
        beside = _tenant(stack.url, keys["tenant"], images, int((duration_s - min(5.0, duration_s / 4)) / 0.5))
        stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        stack.stop()
    return {"attackers": attackers, "duration_s": duration_s, "flood": dict(flood), "alone": alone, "attack": beside}


def _tenant(url: str, key: str, images: list[bytes], count: int) -> dict[str, Any]:
    """`count` photos of the other key, one every 0.5 s: its answers, and a refusal's detail."""
    statuses: Counter[str] = Counter()
    detail = ""
    session = requests.Session()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "image/jpeg"}
    for index in range(count):
        started = time.monotonic()
        response = session.post(f"{url}/v1/jobs", data=images[index % len(images)], headers=headers, timeout=60)
        statuses[str(response.status_code)] += 1
        if response.status_code != 202 and not detail:
            detail = str(response.json().get("detail", ""))
        time.sleep(max(0.0, started + 0.5 - time.monotonic()))
    return {"statuses": dict(statuses), "refused_detail": detail}


def format_padding(outcome: dict[str, Any]) -> str:
    alone, attack = outcome["alone"], outcome["attack"]
    return "\n".join(
        [
            f"padding: {outcome['attackers']} threads of a JPEG padded with 0-4 MiB of zeros for "
            f"{outcome['duration_s']:g} s; the flood's answers {outcome['flood']}",
            f"  the other key alone: {alone['statuses']}",
            f"  the other key beside the flood: {attack['statuses']}"
            + (f"; refused with {attack['refused_detail']!r}" if attack["refused_detail"] else ""),
        ]
    )
