"""`bench peer`: issue 43's synchronous peer (LitServe, bench.load.peer_server) and make run's stack, loaded alike
in the same half hour, runs alternating: the CPU per image of every process of each, against the decode
floor measured right after each run on the same images.

Both get the same load generator, images, closed loop and floor; the peer's processes are those of its own
session (its API server, its inference workers, its multiprocessing manager), ours those bench.load.runs counts.
LitServe is not one of the service's dependencies: `make peer` installs it into .peer/, and only the peer's
process puts that folder on its path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from bench.load import client
from bench.load.report import summarise
from bench.load.runs import measure
from bench.meters.floor import against_floor, decode_floor_ms
from bench.stack import cpu
from bench.stack.processes import REPO_ROOT, free_port, wait_until

PEER_PATH = REPO_ROOT / ".peer"  # where `make peer` installs LitServe (the version issue 43 measured, 0.2.19)


class PeerServer:
    """A peer started in its own session (so that every process it spawns is counted as its):
    `python -m <module> PORT <args>`, with `python_path` on its path, answering GET /health and POST /predict."""

    def __init__(self, workdir: Path, module: str, args: list[str], python_path: str = str(REPO_ROOT)) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "peer.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, str(self.port), *args],
                env={**os.environ, "PYTHONPATH": python_path},
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_until(self._answers, timeout_s=90.0, interval_s=0.25, what="the peer's /health")
        except (AssertionError, RuntimeError):
            self.stop()
            raise

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the peer exited: {self.log.read_text(errors='replace')[-2000:]}")
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds by the peer's roles, over the live processes of its session: its inference workers (the
        spawned ones), its API server and its multiprocessing manager (both forked: the manager first, then
        the server), the parent, and the resource tracker."""
        members = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (read := cpu.read_process(int(entry))) is not None and read[3] == self.process.pid:
                members.append((cpu.start_ticks(int(entry)) or 0, int(entry), read[0], read[2]))
        taken: dict[str, float] = {}
        forked = 0
        for _, pid, cmdline, seconds in sorted(members):
            if "multiprocessing.spawn" in cmdline:
                role = "inference workers"
            elif "resource_tracker" in cmdline:
                role = "resource tracker"
            elif pid == self.process.pid:
                role = "parent"
            else:
                role = "manager" if forked == 0 else "api server"
                forked += 1
            taken[role] = taken.get(role, 0.0) + seconds
        return taken

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def require_litserve(peer_path: Path = PEER_PATH) -> None:
    if not (peer_path / "litserve").is_dir():
        raise SystemExit(f"LitServe is not installed in {peer_path}: run `make peer` first")


def litserve_peer(workdir: Path, profile: str, size: int, peer_path: Path = PEER_PATH) -> PeerServer:
    """Issue 43's peer (bench.load.peer_server), with LitServe from `peer_path` (make peer)."""
    require_litserve(peer_path)
    return PeerServer(workdir, "bench.load.peer_server", [profile, str(size)], f"{peer_path}{os.pathsep}{REPO_ROOT}")


def post_once(session: requests.Session, url: str, image: bytes) -> client.Outcome:
    """The peer's one synchronous POST of a multipart form (what its clients send)."""
    started = time.monotonic()
    try:
        response = session.post(f"{url}/predict", files={"image": ("image.jpg", image, "image/jpeg")}, timeout=90)
    except requests.RequestException as exc:
        return client.Outcome(started, time.monotonic(), "error", type(exc).__name__)
    if response.status_code != 200:
        return client.Outcome(started, time.monotonic(), "rejected", f"http_{response.status_code}")
    return client.Outcome(started, time.monotonic(), "succeeded", None, response.json())


def measure_peer(peer: PeerServer, images: list[bytes], clients: int, duration_s: float, size: int) -> dict[str, Any]:
    """One closed-loop run of the peer, as bench.load.runs.measure runs ours: CPU per image of its processes (and
    of the load generator) and that against the decode floor."""
    client.closed_loop(peer.url, client.ImageStream(images, 0.0, 1), clients, min(5.0, duration_s), send=post_once)
    before, bench_before = peer.cpu_seconds(), time.process_time()
    outcomes = client.closed_loop(peer.url, client.ImageStream(images, 0.0, 0), clients, duration_s, send=post_once)
    after, bench_after = peer.cpu_seconds(), time.process_time()
    result = summarise("peer", "closed", outcomes, None, clients, None, None)
    images_done = result["succeeded"]
    by_role = {
        role: round((seconds - before.get(role, 0.0)) * 1000.0 / images_done, 2) for role, seconds in after.items()
    }
    table = {
        "stack": round(sum(by_role.values()), 2),
        "bench": round((bench_after - bench_before) * 1000.0 / images_done, 2),
    }
    result["cpu_ms_per_image"] = table
    result["peer_roles_ms"] = by_role
    result["floor"] = against_floor(table, decode_floor_ms(images, size))
    result["calls"] = "peer"
    print(
        f"  peer closed c={clients}: {result['achieved_qps']:.2f} QPS, p95 {result['latency_ms']['p95']} ms, "
        f"failed {sum(result['failures'].values())}, CPU {result['floor']['stack_over_floor']:.2f}x the decode floor",
        file=sys.stderr,
    )
    return result


def against_peer(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of our runs' ratio to the floor over the mean of the peer's runs next to it (the one before and
    the one after, where there are both): the issue's "ours against the peer's", within one half hour."""
    rows = []
    peers = [i for i, r in enumerate(results) if r["calls"] == "peer"]
    for i, result in enumerate(results):
        if result["calls"] == "peer" or not peers:
            continue
        near = [j for j in peers if j < i][-1:] + [j for j in peers if j > i][:1]
        peer_ratio = sum(results[j]["floor"]["stack_over_floor"] for j in near) / len(near)
        peer_ms = sum(results[j]["cpu_ms_per_image"]["stack"] for j in near) / len(near)
        ours = result["floor"]["stack_over_floor"]
        rows.append(
            {
                "run": i + 1,
                "calls": result["calls"],
                "ours_over_floor": ours,
                "peer_over_floor": round(peer_ratio, 3),
                "ours_over_peer": round(ours / peer_ratio, 3),
                # The same by milliseconds: the floor, measured after each run, moves by up to ~10% between runs
                # minutes apart; the two sides' CPU per image, minutes apart, by less.
                "ours_over_peer_ms": round(result["cpu_ms_per_image"]["stack"] / peer_ms, 3),
                "redis_ms": result["cpu_ms_per_image"].get("redis-main"),
            }
        )
    return rows


def run_rounds(
    stack: Any,
    workdir: Path,
    images: list[bytes],
    clients: int,
    duration_s: float,
    rounds: int,
    calls: list[str],
    profile: str,
    upload: str = "raw",
) -> dict[str, Any]:
    """`rounds` times: the peer (started, loaded, stopped: its idle processes stay out of our runs), then
    make run's stack (`stack`, started once) once per call mode; a last peer run closes the series."""
    size = client.input_size(stack.url)
    results: list[dict[str, Any]] = []

    def peer_run() -> None:
        peer = litserve_peer(workdir, profile, size)
        try:
            results.append(measure_peer(peer, images, clients, duration_s, size))
        finally:
            peer.stop()

    for _ in range(rounds):
        peer_run()
        for call in calls:
            results.append(
                measure(
                    "service",
                    stack.url,
                    images,
                    "closed",
                    clients,
                    duration_s,
                    scope=stack.cpu_scope(),
                    one_call=call == "one",
                    upload=upload,
                )
            )
    peer_run()
    rows = against_peer(results)
    return {"results": results, "against_peer": rows, "table": markdown(results, rows)}


def markdown(results: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    lines = [
        "### Against the peer (each of our runs over the mean of the peer's runs before and after it)",
        "",
        "| run | calls | images/s | p95 ms | stack ms/image | floor ms | stack / floor | peer / floor | ours / peer "
        "| ours / peer, by ms | Redis main ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_run = {row["run"]: row for row in rows}
    for i, result in enumerate(results, start=1):
        floor = result["floor"]
        row = by_run.get(i)
        lines.append(
            f"| {i} | {result['calls']} | {result['achieved_qps']:.1f} | {result['latency_ms']['p95']} | "
            f"{result['cpu_ms_per_image']['stack']} | {floor['decode_floor_ms']} | {floor['stack_over_floor']:.2f}x | "
            + (
                f"{row['peer_over_floor']:.2f}x | **{row['ours_over_peer']:.2f}x** | {row['ours_over_peer_ms']:.2f}x "
                f"| {row['redis_ms']} |"
                if row
                else "| | | |"
            )
        )
    for i, result in enumerate(results, start=1):
        if result["calls"] == "peer":
            roles = ", ".join(f"{role} {ms:g}" for role, ms in result["peer_roles_ms"].items() if ms >= 0.01)
            lines.append(f"\nRun {i}, the peer's CPU ms per image by role: {roles}.")
    return "\n".join(lines)
