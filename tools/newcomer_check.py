"""The path a newcomer takes, run for real: what CI runs on every landing (scripts/newcomer-check).

    scripts/newcomer-check [--fresh-venv] [--keep]

In a copy of this checkout (the files git tracks or would track: no var/, no .venv of its own unless
--fresh-venv), exactly as README.md and docs/quickstart.md say, with no step they do not name:

0. `make run` with the API's port held by another program: it stops at once, in one line naming the port, who
   holds it and the variable that moves it, and starts nothing;
1. `make run REDIS=private` on a terminal of its own (tools.terminal_session), on free ports (IMGSERVE_API__BIND,
   FLOWER_PORT, GPU_METRICS_PORT: the quick start names them), its output in a log;
2. its "ready at" line, and /readyz answering 200, within READY_LIMIT_S; before it, only make run's own lines and
   the processes' JSON lines (no banner, no bare warning);
3. every ```bash and ```python block of README.md and docs/quickstart.md that is not marked
   `<!-- illustrative -->` on the line before it, as written (localhost:8000 read as the chosen port, and
   IMGSERVE_URL set to it, as the CLI's help says): each exits 0 and prints no problem document;
4. the first example's answer is the sample's truth (samples/shapes-36.truth.json), so the README shows a
   real answer; a read with a mistyped option (`?wiat=10`) is a 400 naming it; a 90 MP image is refused in the
   service's words at the default decode.max_image_pixels;
5. Flower, with the credentials `make run` printed, lists every Celery worker (the CPU and callback workers) and
   finds a job by its id; `GET /` links the docs and Flower; the password is on no command line;
6. Ctrl-C, typed on the terminal: make ends with status 0 (no "Error 130") within STOP_LIMIT_S, and no
   process it started is left (each checked by pid and start time);
7. a second `make run` after `cp .env.example .env` (the README's Docker step) and with decode.max_image_pixels
   raised to 100 M: ready again, Flower's printed credentials (not .env's empty password) open it and `admin:`
   does not, the 90 MP image decodes, a job of the first run is still readable; Ctrl-C again, nothing left;
8. the CLI with the service stopped: one line and a non-zero status.

A failure says which step and prints make run's last log lines; the exit status is then 1. With --fresh-venv
the copy installs its own .venv as a newcomer's would (minutes); by default it links this checkout's, so the
check costs what the service's start does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tools import newcomer_mistakes as mistakes
from tools.newcomer_mistakes import CheckFailed
from tools.ports import free_port
from tools.terminal_session import TerminalSession

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_LIMIT_S = 180.0  # the service's start on a busy 2-core machine, with room to spare; the install comes first
STOP_LIMIT_S = 20.0  # Ctrl-C to every process gone
BLOCK_LIMIT_S = 120.0  # one documented block
DOCUMENTS = ("README.md", "docs/quickstart.md")
ILLUSTRATIVE = "<!-- illustrative"  # on the line before a fence: shown, not run (say why after it)
FIRST_EXAMPLE = "samples/shapes-36.jpg"
PROBLEM = re.compile(r'"status"\s*:\s*[45]\d\d')  # a problem document's numeric status (a job's is a word)
_FENCE = re.compile(r"^```(\w+)\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    language: str  # bash | python
    text: str

    def where(self) -> str:
        return f"{self.document}:{self.line} ({self.language})"


def documented_blocks(root: Path, documents: tuple[str, ...] = DOCUMENTS) -> Iterator[tuple[Block, bool]]:
    """Every ```bash and ```python block of the documents, and whether it is to run (not marked illustrative)."""
    for document in documents:
        lines = (root / document).read_text().splitlines()
        i = 0
        while i < len(lines):
            match = _FENCE.match(lines[i])
            if match and match.group(1) in ("bash", "python", "sh", "shell", "console", "py"):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                language = "python" if match.group(1) in ("python", "py") else "bash"
                marked = i > 0 and lines[i - 1].strip().startswith(ILLUSTRATIVE)
                yield Block(document, i + 1, language, "\n".join(lines[i + 1 : end]) + "\n"), not marked
                i = end
            i += 1


def copy_checkout(source: Path, target: Path, fresh_venv: bool) -> None:
    """The files git tracks or would track (untracked but not ignored: work in progress counts), as a clone
    would hold them."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=source,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        path = source / name
        if path.is_file() and not path.is_symlink():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / name)
    if not fresh_venv and (source / ".venv" / "bin" / "python").exists():
        (target / ".venv").symlink_to(source / ".venv")


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]  # state; starttime (field 22 of stat)


def descendants(root_pid: int) -> dict[int, tuple[str, str]]:
    """Every live process under root_pid (by parent links, whatever session it moved to): pid -> (start time,
    command line)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [root_pid]
    while frontier:
        pid = frontier.pop()
        started = _start_time(pid)
        if started is not None:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = "?"
            found[pid] = (started, command.strip())
        frontier += [child for child, parent in parents.items() if parent == pid]
    return found


def wait_for(condition: Callable[[], Any], limit_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not within {limit_s:g} s")
        time.sleep(interval_s)


class MakeRun:
    """One `make run REDIS=private` on a terminal of its own, as a person runs it."""

    def __init__(self, root: Path, env: dict[str, str], log_path: Path) -> None:
        self.root, self.env, self.log_path = root, env, log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.terminal: TerminalSession | None = None
        self.started_at = 0.0

    def start(self) -> MakeRun:
        self.terminal = TerminalSession(["make", "run", "REDIS=private"], self.root, self.env, self.log_path)
        self.process = self.terminal.process
        self.started_at = time.monotonic()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, api: str) -> str:
        """The "ready at" line (make run's own words), once /readyz answers too."""
        assert self.process is not None

        def ready() -> str | None:
            if self.process is not None and self.process.poll() is not None:
                raise CheckFailed(f"`make run` exited (status {self.process.returncode}) before it was ready")
            match = re.search(r"^make run: ready at .*(?:\n  .*)*", self.log(), re.MULTILINE)
            if not match:
                return None
            try:
                return match.group(0) if requests.get(api + "/readyz", timeout=5).status_code == 200 else None
            except requests.RequestException:
                return None

        line = wait_for(ready, READY_LIMIT_S, '`make run`\'s "ready at" line and /readyz 200')
        print(f"newcomer check: make run ready in {time.monotonic() - self.started_at:.1f} s")
        return str(line)

    def interrupt(self) -> float:
        """Ctrl-C, typed on make's terminal. make must end with 0 (a clean stop: no "Error 130") and every process
        it started must be gone within STOP_LIMIT_S; returns how long it took."""
        assert self.process is not None and self.terminal is not None
        started = descendants(self.process.pid)
        began = time.monotonic()
        self.terminal.type_ctrl_c()
        try:
            status = self.terminal.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"`make run` still running {STOP_LIMIT_S:g} s after Ctrl-C") from None
        finally:
            self.terminal.close()
        if status != 0 or "Error 130" in self.log():
            raise CheckFailed(f"after Ctrl-C make ended with status {status}:\n{self.tail(8)}")
        left = wait_for_gone(started, max(0.5, STOP_LIMIT_S - (time.monotonic() - began)))
        took = time.monotonic() - began
        if left:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            raise CheckFailed(
                "after Ctrl-C these processes of `make run` were still running (killed now): "
                + "; ".join(f"{pid} {command}" for pid, (_, command) in left.items())
            )
        print(f"newcomer check: Ctrl-C stopped `make run` and its {len(started)} processes in {took:.1f} s")
        return took

    def kill(self) -> None:
        """After a failure: nothing of this run may outlive the check."""
        if self.process is not None and self.process.poll() is None:
            for pid in descendants(self.process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def wait_for_gone(started: dict[int, tuple[str, str]], limit_s: float) -> dict[int, tuple[str, str]]:
    deadline = time.monotonic() + limit_s
    while True:
        left = {pid: info for pid, info in started.items() if _start_time(pid) == info[0]}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def run_block(block: Block, root: Path, env: dict[str, str], api: str) -> str:
    text = block.text.replace("http://localhost:8000", api).replace("http://127.0.0.1:8000", api)
    argv = (
        [str(root / ".venv" / "bin" / "python"), "-c", text]
        if block.language == "python"
        else ["bash", "-euo", "pipefail", "-c", text]
    )
    try:
        result = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=BLOCK_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{block.where()} ran over {BLOCK_LIMIT_S:g} s:\n{block.text}") from None
    output = result.stdout + result.stderr
    if result.returncode != 0 or PROBLEM.search(result.stdout):
        why = f"exited {result.returncode}" if result.returncode else "printed a problem document"
        raise CheckFailed(f"{block.where()} {why}:\n{block.text}--- its output:\n{output[-3000:]}")
    print(f"newcomer check: {block.where()} ran ({len(block.text.splitlines())} lines)")
    return result.stdout


def check_first_example(root: Path, api: str) -> str:
    """The README's first example, one call on the sample: the boxes the sample's truth holds. Returns its id."""
    answer = requests.post(
        api + "/v1/jobs",
        params={"wait": 20},
        timeout=60,
        files={"image": (FIRST_EXAMPLE, (root / FIRST_EXAMPLE).read_bytes(), "image/jpeg")},
    )
    if answer.status_code != 200:
        raise CheckFailed(f"one call on {FIRST_EXAMPLE}: {answer.status_code} {answer.text[:500]}")
    doc = answer.json()
    truth = json.loads((root / FIRST_EXAMPLE.replace(".jpg", ".truth.json")).read_text())["objects"]
    found = [d for d in doc["result"]["detections"]]
    for expected in truth:
        if not any(d["label"] == expected["label"] and _iou(d["box"], expected["box"]) > 0.7 for d in found):
            raise CheckFailed(f"{FIRST_EXAMPLE}: no {expected['label']} at {expected['box']} in the answer: {found}")
    if len(found) != len(truth):
        raise CheckFailed(f"{FIRST_EXAMPLE}: {len(found)} detections where the README shows {len(truth)}: {found}")
    print(f"newcomer check: the first example answers its truth ({', '.join(d['label'] for d in found)})")
    return str(doc["id"])


def _iou(a: list[float], b: list[float]) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def check_flower(ready_line: str, flower_port: int) -> tuple[str, tuple[str, str]]:
    """Flower answers with the credentials make run printed, and lists both Celery workers. Returns its URL and
    those credentials."""
    match = re.search(r"Flower at (http://\S+) \(user '([^']+)', password (\S+) ", ready_line)
    if not match:
        raise CheckFailed(f"the ready line names no Flower credentials:\n{ready_line}")
    url, user, password = match.groups()
    if not url.endswith(f":{flower_port}"):
        raise CheckFailed(f"Flower is said to be at {url}, not on FLOWER_PORT {flower_port}")

    def workers() -> list[str] | None:
        try:
            response = requests.get(url + "/api/workers", params={"refresh": "1"}, auth=(user, password), timeout=20)
        except requests.RequestException:
            return None
        names = sorted(response.json()) if response.status_code == 200 else []
        roles = {name.split("@")[0] for name in names}
        return names if {"cpu", "callbacks"} <= roles else None

    names = wait_for(workers, 60, "Flower listing the CPU and the callback worker", interval_s=2.0)
    if requests.get(url + "/api/workers", timeout=10).status_code != 401:
        raise CheckFailed("Flower answered without credentials")
    if requests.get(url + "/broker", auth=(user, password), timeout=20).status_code != 200:
        raise CheckFailed("Flower's Broker tab does not answer 200")
    print(f"newcomer check: Flower, with the printed credentials, lists {', '.join(names)}")
    return url, (user, password)


def newcomer_env(root: Path, api_port: int, flower_port: int, metrics_port: int) -> dict[str, str]:
    """The environment of someone who just cloned: nothing of this project's set, the ports the docs name."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("IMGSERVE_", "FLOWER_", "PROMETHEUS_", "VIRTUAL_ENV", "PYTHON", "CPU_WORKERS", "GPU_METRICS", "REDIS")
        )
    }
    env.update(
        {
            "IMGSERVE_API__BIND": f"127.0.0.1:{api_port}",
            "FLOWER_PORT": str(flower_port),
            "GPU_METRICS_PORT": str(metrics_port),
            "IMGSERVE_URL": f"http://127.0.0.1:{api_port}",
        }
    )
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if ".venv" not in p)
    return env


def check(workdir: Path, fresh_venv: bool) -> None:
    root = workdir / "imgserve"
    root.mkdir()
    copy_checkout(REPO_ROOT, root, fresh_venv)
    api_port, flower_port, metrics_port = free_port(), free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}"
    env = newcomer_env(root, api_port, flower_port, metrics_port)
    blocks = [block for block, runs in documented_blocks(root) if runs]
    mistakes.check_busy_port(root, env, api_port)
    first = MakeRun(root, env, workdir / "make-run-1.log")
    step = "the first `make run`"
    try:
        first.start()
        ready_line = first.wait_ready(api)
        if f"ready at {api}" not in ready_line:
            raise CheckFailed(f"the ready line names another address than {api}:\n{ready_line}")
        step = "a quiet start"
        mistakes.check_quiet_start(first.log())
        step = "the first example"
        kept_id = check_first_example(root, api)
        step = "a mistyped option"
        mistakes.check_mistyped_option(api, kept_id)
        step = "a 90 MP image at the default pixel limit"
        mistakes.check_pixel_limit(api, 80_000_000)
        for block in blocks:
            step = f"the block at {block.where()}"
            run_block(block, root, env, api)
        step = "Flower"
        flower, auth = check_flower(ready_line, flower_port)
        mistakes.check_home_and_flower(api, flower, auth, kept_id)
        mistakes.check_no_secret_on_command_lines(auth[1])
        step = "Ctrl-C of the first `make run`"
        first.interrupt()
    except BaseException as exc:
        first.kill()
        raise CheckFailed(_failure(step, exc, first)) from exc
    # The README's Docker step, then make run again: .env's empty Flower password must not be what is in force.
    shutil.copy(root / ".env.example", root / ".env")
    raised = {**env, "IMGSERVE_DECODE__MAX_IMAGE_PIXELS": str(mistakes.RAISED_PIXELS)}
    second = MakeRun(root, raised, workdir / "make-run-2.log")
    step = "the second `make run`, with .env.example copied to .env"
    try:
        second.start()
        ready_line = second.wait_ready(api)
        step = "Flower, with .env.example copied to .env"
        flower, auth = check_flower(ready_line, flower_port)
        if auth[0] == "admin" or not auth[1]:
            raise CheckFailed(f"the printed credentials are .env's empty ones:\n{ready_line}")
        step = "a 90 MP image with the pixel limit raised"
        big_id = mistakes.check_pixel_limit(api, mistakes.RAISED_PIXELS)
        step = "Flower and GET /, with .env.example copied to .env"
        mistakes.check_home_and_flower(api, flower, auth, big_id)
        step = "a job of the first run, read in the second"
        doc = requests.get(f"{api}/v1/jobs/{kept_id}", timeout=10)
        if doc.status_code != 200 or doc.json()["status"] != "succeeded":
            raise CheckFailed(f"job {kept_id} of the first run: {doc.status_code} {doc.text[:300]}")
        print(f"newcomer check: job {kept_id} of the first run is readable in the second")
        step = "Ctrl-C of the second `make run`"
        second.interrupt()
    except BaseException as exc:
        second.kill()
        raise CheckFailed(_failure(step, exc, second)) from exc
    mistakes.check_cli_with_the_api_down(root, env, api)


def _failure(step: str, exc: BaseException, run: MakeRun) -> str:
    return f"{step} failed: {exc}\n--- the last lines of `make run` ({run.log_path}):\n{run.tail()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/newcomer-check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fresh-venv",
        action="store_true",
        help="install the copy's own .venv (as a newcomer does; minutes) instead of linking this one",
    )
    parser.add_argument("--keep", action="store_true", help="keep the copy and the logs (printed where)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="newcomer-"))
    began = time.monotonic()
    try:
        check(workdir, args.fresh_venv)
    except CheckFailed as failure:
        print(
            f"newcomer check FAILED: make run, the README's first command, as a newcomer runs it: {failure}",
            file=sys.stderr,
        )
        print(f"newcomer check: the copy and its logs are kept in {workdir}", file=sys.stderr)
        return 1
    print(f"newcomer check: passed in {time.monotonic() - began:.0f} s")
    if args.keep:
        print(f"newcomer check: the copy and its logs are in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
