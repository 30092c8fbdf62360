"""`bench plane`: what the control plane's Redis spends on an image, step by step, and the ceiling that sets.

The product's own processes (the API, a Celery CPU worker with events on, the GPU worker on a simulated device
with no device time) run against a private Redis, and images too small to cost any decode (640x16 JPEGs: a frame
of 8 KB) go through them in phases, so that Redis's own counters (`INFO cpu`'s main thread, `INFO commandstats`)
read before and after each phase say what each step cost:

1. intake: N submissions over HTTP (admission, the result cache's lookup, the upload, the record, the Celery
   message), with no CPU worker running yet;
2. cpu: the CPU worker, started before with its queues parked, given them: Celery's consume, its ack emulation and
   events, the claim, the frame's push;
3. gpu: the GPU worker started: its pops, the batches' one write each (the ends, the acks, the PUBLISH that wakes
   long-polls), in full batches, as at the load the ceiling is about;
4. read: each job read once, as a long-poll's wake does (one read of the record).

Costs paid once, not an image at a time, are measured apart and left out of an image's figures: the first
submissions, while the deadline index is still a listpack (a phased run holds every job at once and pays each
insert's walk of it once), and the first answers, while the result cache's LRU index is one; the CPU worker's start
(its connections and their HELLO and CLIENT, kombu's binding scripts and their SCRIPT LOAD, Celery's events and
heartbeat, the library check: once a process), with its job queues renamed aside meanwhile until its consumer waits
in BRPOP (seen in CLIENT LIST), and given back as the cpu step begins (its prefork children open their own
connections at their first task, in that step); and the GPU worker's start (its SCAN of the keyspace for frame lists
nobody reads, its requeue and epoch), with the frames parked aside meanwhile. Both sides of `--base` run this bench:
what it parks is named as both checkouts name it. The CPU workers' lost-delivery check, which reads every live job
each round (here every image at once), is left out (its period set to an hour).

Round trips are counted at the product's own connections (bench/meters/round_trips/sitecustomize.py: each process counts
its own, a pipeline or MULTI block as one), by process and by Redis server; Redis's own counters cannot say them.

Each phase is run alone, so idle chatter (heartbeats, sweeps, Celery's BRPOP timeouts) is priced into the phase
it falls in; the report says how much of it there was. HTTP and decode cost the Redis nothing and are left to the
whole-stack view (`bench run --stack local --shards 1`). `--base REF` runs the same phases on another checkout
(a git worktree), one after the other, and prints both; `--rounds N` runs the two N times alternately, each first
in every other round (base, this checkout; this checkout, base; ...), and prints each round's figures, each side's
median over the rounds and the median of the rounds' ratios: both sides move from run to run on a shared machine,
and alternating puts them under the same drift.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import requests
import yaml
from urllib3.util.retry import Retry

from bench.meters.plane_meter import (
    ApartCache,
    InstructionCounter,
    PhaseCost,
    PhaseMeter,
    RoundTripCounter,
    added_round_trips,
)
from bench.meters.plane_report import APART, PHASES, report, rounds_report
from bench.stack.local import api_env
from bench.stack.processes import (
    REPO_ROOT,
    ManagedProcess,
    RedisServer,
    api_argv,
    cpu_worker_argv,
    free_port,
    gpu_worker_argv,
    wait_until,
)
from contract.redis.keys import PREPROCESS_QUEUE, Keys
from contract.settings import Settings
from contract.settings.config import load_settings

GPU_WORKER_ID = "plane-gpu"


def tiny_jpegs(count: int, seed: int = 1) -> list[bytes]:
    """Distinct 640x16 JPEGs (each a different image: the result cache misses every one)."""
    from PIL import Image

    rng = random.Random(seed)
    images = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.new("RGB", (640, 16), (rng.randrange(256), rng.randrange(256), rng.randrange(256))).save(
            buffer, "JPEG", quality=80
        )
        images.append(buffer.getvalue())
    return images


PLANE_KEY = "plane-key"  # --keyed: the one API key every submission carries


def plane_config(redis_url: str, shard_urls: list[str], images: int, keyed: bool = False) -> dict[str, Any]:
    room = images + 64
    config: dict[str, Any] = {
        "redis_url": redis_url,
        "gpu_worker": {"device": "sim", "sim_latency_ms": {1: 0.1, 8: 0.1}},
        # every image of a phase waits at once: budgets wide enough for all of them
        "backpressure": {"max_frames": room, "max_backlog": room * 2},
        "auth": {"max_backlog_share": 1.0},
        # The lost-delivery check reads every live job each round (every 5 s): in service the jobs in flight, here
        # every image at once, so a round priced one HMGET an image into whichever step it fell in. Left out.
        "celery": {"lost_delivery_s": 3600.0},
        # Deadlines that outlast every phase: on a loaded machine, under callgrind, the phases before the GPU's took
        # past the default minute, and jobs expired before it priced no answer's write.
        "jobs": {"default_deadline_ms": 900_000, "upload_ttl_s": 1200},
    }
    if shard_urls:
        config["bulk"] = {"redis_urls": shard_urls}
    if keyed:  # as a keyed deployment: the key's own queue and its share of the budgets counted
        digest = hashlib.sha256(PLANE_KEY.encode()).hexdigest()
        config["auth"] = {**config["auth"], "api_keys": [{"id": "plane", "sha256": digest}]}
    return config


def run_phases(
    root: Path,
    images: int,
    shards: int,
    clients: int,
    workdir: Path,
    instructions: bool = False,
    keyed: bool = False,
    set_apart: int | None = None,
    cache_redis: bool = False,
) -> dict[str, Any]:
    """The four phases on the checkout at `root`: per phase and in all, the control plane's cost per image
    (`instructions`: its Redis under callgrind, its instructions counted too; `keyed`: every submission with an
    API key), and the two reported apart (APART). `set_apart`: how many first submissions are measured apart (by
    default the deadline index's listpack size, when there are over twice as many images). `cache_redis`: the
    result cache on a Redis of its own, its cost reported apart (ApartCache)."""
    workdir.mkdir(parents=True, exist_ok=True)
    trips = RoundTripCounter(workdir / "round-trips")
    counter = InstructionCounter(workdir) if instructions else None
    control = RedisServer(workdir, wrapper=counter.wrapper() if counter else (), root=root)
    if counter:
        counter.pid = control.process.pid
    bulk = []
    for index in range(shards):
        folder = workdir / f"shard{index}"
        folder.mkdir(exist_ok=True)
        bulk.append(RedisServer(folder, root=root))
    cache = ApartCache(workdir, root, instructions) if cache_redis else None
    config = plane_config(control.url, [s.url for s in bulk], images, keyed)
    if cache:  # patient: under callgrind the cache Redis answers past the default timeout, and writes were dropped
        config["cache"] = {"redis_url": cache.server.url, "timeout_ms": 30_000}
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "IMGSERVE_CONFIG": str(config_path), "PYTHONUNBUFFERED": "1", **api_env(port, 1, 64)}
    for name in ("IMGSERVE_REDIS_URL", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    processes: list[ManagedProcess] = []
    client = redis.Redis.from_url(control.url)
    bulk_clients = [redis.Redis.from_url(s.url) for s in bulk]
    payloads = tiny_jpegs(images)
    session = requests.Session()
    # A read is sent again once when the API closed a kept-alive connection as it was reused (the keep-alive race: a
    # connection idle since the intake step); a submission is not (it would make a second job).
    again = Retry(total=1, connect=1, read=1, allowed_methods=frozenset({"GET"}), raise_on_status=False)
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=clients, max_retries=again)
    session.mount("http://", adapter)
    meter = PhaseMeter(client, bulk_clients, images, counter, trips)
    meter.cache = cache
    measured = meter.measure
    set_apart = _listpack_apart(client, images) if set_apart is None else set_apart
    settings = load_settings(config_path)
    keys = Keys(settings.namespace)
    frame_lists = Progress(bulk_clients or [client], [keys.frames(model.key) for model in settings.models])
    job_queues = ParkedQueues(client, job_queue_keys(keys, settings))

    def spawn(name: str, argv: list[str]) -> None:
        processes.append(ManagedProcess(name, argv, trips.env(env, name), workdir, root=root))

    try:
        spawn("api", api_argv())
        wait_until(lambda: api_answers(url + "/healthz", processes), 60, interval_s=0.2, what="the API")

        def submit(payload: bytes) -> str:
            headers = {"Content-Type": "image/jpeg", **({"Authorization": f"Bearer {PLANE_KEY}"} if keyed else {})}
            reply = session.post(url + "/v1/jobs", data=payload, headers=headers, timeout=30)
            if reply.status_code != 202:
                raise RuntimeError(f"submit answered {reply.status_code}: {reply.text[:300]}")
            return str(reply.json()["id"])

        with ThreadPoolExecutor(clients) as pool:
            first, rest = payloads[:set_apart], payloads[set_apart:]
            ids = measured("intake-listpack", lambda: list(pool.map(submit, first)), images=len(first) or 1)
            ids += measured("intake", lambda: list(pool.map(submit, rest)), images=len(rest) or 1)

            # The CPU worker's start measured alone, as the GPU worker's is: its job queues parked meanwhile, so that
            # it starts and sits idle in BRPOP, then given back as the cpu step begins (a RENAME wakes that BRPOP).
            job_queues.park()
            before_start = {entry["id"] for entry in client.client_list()}

            def cpu_start() -> None:
                spawn("cpu-worker", cpu_worker_argv(2))
                wait_until(
                    lambda: _idle_in_brpop(client, before_start, processes),
                    300,
                    interval_s=0.1,
                    what="the CPU worker idle in BRPOP",
                )

            measured("cpu-start", cpu_start, images=1)

            def cpu_phase() -> None:
                job_queues.give_back()
                wait_until(
                    lambda: frame_lists.frames_waiting() >= images,
                    300,
                    interval_s=0.2,
                    what="every frame pushed",
                )

            measured("cpu", cpu_phase)
            # The frames parked while the GPU worker starts, so that its start is measured alone; given back at
            # once after (a RENAME wakes its blocked pop).
            frame_lists.park()

            def gpu_start() -> None:
                spawn("gpu-worker", gpu_worker_argv("sim", GPU_WORKER_ID))
                heartbeat = keys.heartbeat(GPU_WORKER_ID)
                wait_until(lambda: _lives(client, heartbeat, processes), 300, interval_s=0.2, what="the GPU worker")

            measured("gpu-start", gpu_start, images=1)

            # The first answers apart, as the first submissions are: the result cache's LRU index is a listpack
            # until it holds zset-max-listpack-entries digests, and each answer's ZADD walks it (once a cache's life).
            answered = _Ended(client, keys.deadlines)
            measured("gpu-listpack", lambda: answered.after(frame_lists, images - set_apart), images=set_apart or 1)
            measured("gpu", lambda: answered.after(frame_lists, 0), images=images - set_apart or 1)

            def read(job_id: str) -> str:
                headers = {"Authorization": f"Bearer {PLANE_KEY}"} if keyed else {}
                return str(session.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()["status"])

            statuses = measured("read", lambda: list(pool.map(read, ids)))
        idle = meter.idle(3.0)
        record = _ended_record(client, [keys.job(job_id) for job_id in ids[:50]])
        # every image's entry, if none dropped (entries are its keys with a TTL: no books there)
        cached = int(cache.client.info("keyspace").get("db0", {}).get("expires", 0)) if cache else None
    finally:
        for process in reversed(processes):
            process.stop()
        control.stop()
        for shard in [*bulk, *([cache.server] if cache else [])]:
            shard.stop()
    ended = {status: statuses.count(status) for status in set(statuses)}
    costs, shard_costs, seconds = meter.net(idle), meter.shard_costs, meter.seconds
    total = total_cost([costs[phase] for phase in PHASES])
    return {
        "images": images,
        "shards": shards,
        "set_apart": set_apart,
        "record": record,
        "ended": ended,
        "phases": {phase: costs[phase] for phase in PHASES},
        "apart": {phase: costs[phase] for phase in APART},
        "shard_phases": shard_costs,
        "seconds": seconds,
        "total": total,
        "idle_per_s": idle,
        "cache_entries": cached,
        "cache_phases": meter.net(meter.cache_idle, meter.cache_costs) if meter.cache_idle else {},
    }


class _Ended:
    """bench plane's GPU phases: frames given back, then the jobs ended (out of the deadline index, whatever the GPU
    worker's counters say, or when) until `left` remain."""

    def __init__(self, client: redis.Redis, deadlines: str) -> None:
        self.client, self.deadlines = client, deadlines

    def after(self, frame_lists: Progress, left: int) -> None:
        if left:
            frame_lists.release_oldest(int(self.client.zcard(self.deadlines)) - left)
        else:
            frame_lists.park(back=True)
        wait_until(lambda: self.client.zcard(self.deadlines) <= left, 300, interval_s=0.2, what="the jobs ended")


class Progress:
    """How far a phase is (bench plane's and bench plane --cells'), read from keys named in advance (a SCAN for
    them, over every record, would be priced into the phase)."""

    def __init__(self, clients: list[redis.Redis], keys: list[str]) -> None:
        self.keys = [(client, key) for client in clients for key in keys]

    def frames_waiting(self) -> int:
        return sum(int(c.llen(key)) for c, key in self.keys)

    def release_oldest(self, count: int) -> None:
        """The `count` oldest parked frames of each list back under its name (the oldest at the right, as taken)."""
        for client, key in self.keys:
            parked = key + ":parked-by-bench-plane"
            pipe = client.pipeline(transaction=False)
            for _ in range(count):
                pipe.lmove(parked, key, "RIGHT", "LEFT")
            pipe.execute()

    def park(self, back: bool = False) -> None:
        """Each list there renamed aside (`back`: to its name again)."""
        for client, key in self.keys:
            parked = key + ":parked-by-bench-plane"
            if back and client.exists(key):  # some given back before (release_oldest): the rest behind them
                while client.lmove(parked, key, "RIGHT", "LEFT") is not None:
                    pass
            elif client.exists(parked if back else key):
                client.rename(*((parked, key) if back else (key, parked)))


def job_queue_keys(keys: Keys, settings: Settings) -> list[str]:
    """The lists a CPU worker on `-Q preprocess` takes jobs from (tasks.worker): the plain queue and each model's,
    one per API key too. Named as this checkout's Keys name them, as the base's do (contract/keys.py, before it
    moved)."""
    models = [model.key for model in settings.models]
    names = [PREPROCESS_QUEUE, *(queue for key in models for queue in keys.preprocess_queues(key, settings.tenants))]
    return [keys.celery_queue(name) for name in dict.fromkeys(names)]


class ParkedQueues:
    """Celery's job queues renamed aside (those that hold messages) while a CPU worker starts, and given back in one
    round trip: what the worker's start costs is then measured apart from what its takes cost."""

    SUFFIX = ":parked-by-bench-plane"

    def __init__(self, client: redis.Redis, keys: list[str]) -> None:
        self.client, self.keys = client, keys
        self.parked: list[str] = []

    def park(self) -> None:
        self.parked = [key for key in self.keys if self.client.exists(key)]
        for key in self.parked:
            self.client.rename(key, key + self.SUFFIX)

    def give_back(self) -> None:
        if not self.parked:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in self.parked:
            pipe.rename(key + self.SUFFIX, key)
        pipe.execute()
        self.parked = []


def _idle_in_brpop(client: redis.Redis, before: set[str], processes: list[ManagedProcess]) -> bool:
    """A connection opened since `before` (CLIENT LIST ids) blocked in BRPOP: the CPU worker's consumer waiting on
    its empty queues, its start (connections, bindings, the library check, the first beat) behind it."""
    for process in processes:
        if not process.alive():
            raise RuntimeError(f"{process.name} died:\n{process.log_tail()}")
    return any(
        entry["id"] not in before and entry.get("cmd") == "brpop" and "b" in entry.get("flags", "")
        for entry in client.client_list()
    )


def _ended_record(client: redis.Redis, keys: list[str]) -> dict[str, Any]:
    """What an ended job's record takes in Redis (MEMORY USAGE of every field, the mean of `keys`), and its encoding."""
    sizes = [int(client.memory_usage(key, samples=0) or 0) for key in keys]  # every field, not 5 sampled
    raw = [client.object("encoding", key) for key in keys]
    encodings = {value.decode() if isinstance(value, bytes) else str(value) for value in raw}
    return {"bytes": sum(sizes) / max(1, len(sizes)), "encodings": sorted(encodings)}


def _listpack_apart(client: redis.Redis, images: int) -> int:
    """The submissions measured apart: as many as the deadline index holds as a listpack, given images enough."""
    listpack = int(str(client.config_get("zset-max-listpack-entries")["zset-max-listpack-entries"]))
    return listpack if images > 2 * listpack else 0


def _lives(client: redis.Redis, heartbeat: str, processes: list[ManagedProcess]) -> bool:
    for process in processes:
        if not process.alive():
            raise RuntimeError(f"{process.name} died:\n{process.log_tail()}")
    return bool(client.exists(heartbeat))


def total_cost(costs: list[PhaseCost]) -> PhaseCost:
    """The phases' costs added up, command by command."""
    counted = [c.instructions for c in costs if c.instructions is not None]
    total = PhaseCost(
        sum(c.us for c in costs),
        sum(c.commands for c in costs),
        instructions=sum(counted) if counted else None,
        round_trips=added_round_trips([c.round_trips for c in costs]),
    )
    for cost in costs:
        for name, (calls, us) in cost.by_command.items():
            old_calls, old_us = total.by_command.get(name, (0.0, 0.0))
            total.by_command[name] = (old_calls + calls, old_us + us)
    return total


def api_answers(url: str, processes: list[ManagedProcess]) -> bool:
    for process in processes:
        if not process.alive():
            raise RuntimeError(f"{process.name} died:\n{process.log_tail()}")
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def worktree(ref: str, into: Path) -> Path:
    """A checkout of `ref` beside this one (git worktree, detached), for --base."""
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(into), ref], cwd=REPO_ROOT, check=True, capture_output=True
    )
    return into


def run(
    images: int,
    shards: int,
    clients: int,
    base: str | None,
    instructions: bool = False,
    keyed: bool = False,
    cache_redis: bool = False,
    rounds: int = 1,
) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    """`cache_redis`: this checkout's side with the result cache on a Redis of its own (the base's as it is).
    `rounds`: the sides run alternately that many times (base, this checkout; this checkout, base; ...), so that
    the machine's drift falls on both alike; each round's sides, the base's first."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-plane-"))
    every: list[dict[str, dict[str, Any]]] = []
    try:
        root = worktree(base, scratch / "base") if base else None
        head = "this checkout" + (", cache Redis" if cache_redis else "")
        for index in range(rounds):
            sides: dict[str, dict[str, Any]] = {}
            # Every other round the checkout goes first (base, checkout; checkout, base; ...): a drift within a
            # round (the machine warming or a neighbour starting) then falls on each side first as often.
            for side in ("base", "head") if index % 2 == 0 else ("head", "base"):
                if side == "base" and root is not None:
                    base_run = scratch / f"run-base-{index}"
                    sides[f"base {base}"] = run_phases(root, images, shards, clients, base_run, instructions, keyed)
                elif side == "head":
                    head_run = scratch / f"run-head-{index}"
                    sides[head] = run_phases(
                        REPO_ROOT,
                        images,
                        shards,
                        clients,
                        head_run,
                        instructions,
                        keyed,
                        cache_redis=cache_redis,
                    )
            every.append({name: sides[name] for name in sorted(sides, key=lambda name: name == head)})
    finally:
        if base:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(scratch / "base")], cwd=REPO_ROOT, capture_output=True
            )
        shutil.rmtree(scratch, ignore_errors=True)
    if rounds == 1:
        return report(every[0]), every
    last = f"## The last round (round {rounds} of {rounds}) in full\n\n" + report(every[-1])
    return last + "\n" + rounds_report(every), every
