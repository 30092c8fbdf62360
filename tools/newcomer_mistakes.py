"""The newcomer check's second half (tools.newcomer_check runs these): what a new user trips on in the first five
minutes, each tried as they would try it, each a CheckFailed when it does not hold."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import requests

BUSY_PORT_LIMIT_S = 60.0  # make run's own install check, then the settings: no service may start
# A 1-bit PNG of 10000x9000: 90 MP (over Pillow's own limit, 89,478,485; under a raised decode.max_image_pixels) in
# a few KB, decoded to 11 MB.
BIG_SIZE = (10000, 9000)
RAISED_PIXELS = 100_000_000
FLOWER_LIMIT_S = 30.0


class CheckFailed(Exception):
    """A step of the newcomer's path did not hold."""


def big_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", BIG_SIZE).save(buffer, "PNG")
    return buffer.getvalue()


def check_busy_port(root: Path, env: dict[str, str], api_port: int) -> None:
    """`make run` with the API's port held by another program: it stops at once, in one line that names the port,
    who holds it and the variable that moves it, and starts nothing (no Redis of its own)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", api_port))
        holder.listen(1)
        began = time.monotonic()
        done = subprocess.run(
            ["make", "run", "REDIS=private"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=BUSY_PORT_LIMIT_S,
            stdin=subprocess.DEVNULL,
        )
    took = time.monotonic() - began
    said = [line for line in (done.stdout + done.stderr).splitlines() if "not starting" in line]
    if done.returncode == 0 or len(said) != 1:
        raise CheckFailed(f"a busy API port: status {done.returncode}, output:\n{done.stdout}{done.stderr}")
    line = said[0]
    for part in (f"port {api_port}", f"pid {os.getpid()}", "IMGSERVE_API__BIND="):
        if part not in line:
            raise CheckFailed(f"a busy API port: the line does not name {part!r}: {line}")
    if "run-local: Redis:" in done.stdout + done.stderr:
        raise CheckFailed("a busy API port: make run started its Redis before it looked at the ports")
    print(f"newcomer check: a busy port stops make run in {took:.1f} s, in one line: {line}")


def check_quiet_start(log: str) -> None:
    """Everything before the ready line is make run's own lines or a process's JSON line: no banner, no bare
    warning (a start printed ~80 lines of them), and each process says it is up."""
    before = log.split("make run: ready at", 1)[0]
    ours = ("procfile:", "run-local:", "bootstrap:")
    strays = [line for line in before.splitlines() if line.strip() and not line.startswith(ours) and not _json(line)]
    if strays:
        raise CheckFailed("the start printed lines that are neither make run's nor JSON:\n" + "\n".join(strays[:20]))
    roles = {str(entry.get("role")) for entry in map(_json, before.splitlines()) if entry}
    if not {"api", "cpu-worker", "callback-worker", "gpu-worker", "flower"} <= roles:
        raise CheckFailed(f"not every process said it is up before the ready line: {sorted(roles)}")
    print(f"newcomer check: the start is {len(before.splitlines())} lines, each make run's own or JSON")


def _json(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def check_mistyped_option(api: str, job_id: str) -> None:
    """`?wiat=10` on a read: a 400 naming it (it was a 200 at once, no long-poll, no word why)."""
    answer = requests.get(f"{api}/v1/jobs/{job_id}", params={"wiat": "10"}, timeout=10)
    names = [p.get("name") for p in answer.json().get("invalid_params", [])] if answer.status_code == 400 else []
    if names != ["wiat"]:
        raise CheckFailed(f"GET with a mistyped option: {answer.status_code} {answer.text[:300]}")
    print(f"newcomer check: a mistyped option is a 400: {answer.json()['detail']}")


def check_pixel_limit(api: str, limit: int) -> str:
    """A 90 MP image: refused in the service's words at the default limit (80 M), decoded once the limit is
    raised past Pillow's own (89.5 M), which refused it in Pillow's words before."""
    answer = requests.post(
        f"{api}/v1/jobs", params={"wait": 30}, data=big_png(), headers={"Content-Type": "image/png"}, timeout=60
    )
    doc = answer.json()
    if limit >= BIG_SIZE[0] * BIG_SIZE[1]:
        if doc.get("status") != "succeeded":
            raise CheckFailed(f"a 90 MP image under decode.max_image_pixels={limit}: {answer.text[:400]}")
        print(f"newcomer check: a 90 MP image decodes with decode.max_image_pixels raised to {limit}")
        return str(doc["id"])
    message = (doc.get("error") or {}).get("message", "")
    expected = f"image of {BIG_SIZE[0]}x{BIG_SIZE[1]} pixels exceeds the limit of {limit} (decode.max_image_pixels)"
    if doc.get("status") != "failed" or message != expected:
        raise CheckFailed(f"a 90 MP image at the default limit: {answer.text[:400]}")
    print(f"newcomer check: a 90 MP image is refused in the service's words: {message}")
    return str(doc["id"])


def check_home_and_flower(api: str, flower: str, auth: tuple[str, str], job_id: str) -> None:
    """`GET /` links the docs and Flower; Flower finds a job by the job's id; the empty password of a copied
    .env.example opens nothing."""
    home = requests.get(api + "/", timeout=10).json()
    if home["links"].get("docs") != api + "/docs" or home["links"].get("flower") != flower:
        raise CheckFailed(f"GET / does not link the docs and Flower: {home}")
    deadline = time.monotonic() + FLOWER_LIMIT_S  # Flower learns of a task from the workers' events
    while True:
        info = requests.get(f"{flower}/api/task/info/{job_id}", auth=auth, timeout=20)
        if info.status_code == 200 and info.json().get("uuid") == job_id:
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"Flower does not know job {job_id} by its id: {info.status_code} {info.text[:200]}")
        time.sleep(1.0)
    if requests.get(f"{flower}/api/workers", auth=("admin", ""), timeout=20).status_code != 401:
        raise CheckFailed("Flower answered admin with an empty password")
    print("newcomer check: GET / links the docs and Flower; Flower finds a job by its id; admin: is refused")


def check_no_secret_on_command_lines(password: str) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if password.encode() in command:
            shown = command.replace(b"\0", b" ").decode(errors="replace")[:200]
            raise CheckFailed(f"Flower's password is on a command line (ps -ef shows it): pid {pid} {shown}")
    print("newcomer check: Flower's password is on no command line")


def check_cli_with_the_api_down(root: Path, env: dict[str, str], api: str) -> None:
    """With the service stopped: one line and a non-zero status, not a 74-80-line traceback."""
    for command in (["models"], ["status", "0" * 32]):
        done = subprocess.run(
            [str(root / ".venv" / "bin" / "imgserve"), *command],
            cwd=root,
            env={**env, "IMGSERVE_URL": api},
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = done.stderr.splitlines()
        if done.returncode == 0 or len(lines) != 1 or not re.match(r"imgserve: cannot reach the API at ", lines[0]):
            raise CheckFailed(f"imgserve {' '.join(command)} with the API down: {done.returncode}\n{done.stderr}")
    print(f"newcomer check: the CLI with the API down says so in one line: {lines[0]}")
