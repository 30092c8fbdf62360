"""`bench reads`: the API's CPU per read of a job, by the size of its answer (issue 70's finding 4).

In this process: the real app (`create_app`) on a private redis-server, through Flask's test client, a finished
job written as the GPU worker writes one, with a result of `detections` detections. `time.process_time` around
N reads of it (the least of REPEATS runs): the API's own CPU (the Redis server's is another process's). Each
size is read twice: with the result served as stored (what the API does) and parsed and validated as before
(the same app, its store told to parse results), so the two figures come from one run on one machine.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stack.processes import RedisServer

SIZES = (3, 1000)  # a normal answer, and max_det's cap
REPEATS = 5


def result_document(detections: int, seed: int = 0) -> dict[str, Any]:
    """A result as the GPU worker writes one (gpu_worker.finish.documents_from_rows): its detections spread."""
    found = []
    for i in range(detections):
        x, y = float((i * 37 + seed) % 1200) + 0.25, float((i * 53 + seed) % 680) + 0.5
        found.append({"box": [x, y, x + 31.17, y + 17.83], "score": round(0.9999 - i / 2000, 4), "class_id": i % 3})
        found[-1]["label"] = ("circle", "square", "triangle")[i % 3]
    return {
        "detections": found,
        "image": {"width": 1280, "height": 720},
        "model": {"name": "shapes-yolo", "version": "2.0.0"},
    }


def finished_job(job_id: str, result: dict[str, Any] | str, now: float) -> dict[str, Any]:
    """A succeeded job's hash fields as the stages leave them; `result` as a dict or as the text to store."""
    return {
        "id": job_id,
        "status": "succeeded",
        "model": "shapes-yolo:2.0.0",
        "received_at": now - 0.05,
        "deadline_at": now + 30.0,
        "finished_at": now,
        "options": {"conf": 0.0, "iou": 1.0, "max_det": 1000},
        "result": result,
        "timings": {"receive": 1.0, "total": 50.0},
        "batch": {"id": "w:1", "seq": 1, "size": 8, "index": 0, "closed_by": "full", "worker": "w"},
    }


def store_job(client: Any, keys: Any, fields: dict[str, Any]) -> None:
    from contract.jobs.record import encode_fields

    encoded = encode_fields(fields)
    if isinstance(fields["result"], str):
        encoded["result"] = fields["result"]
    client.hset(keys.job(fields["id"]), mapping=encoded)


def measure(redis_url: str, reads: int, workdir: Path) -> list[dict[str, Any]]:
    import redis

    from app import create_app
    from app.services import services
    from contract.jobs.record import new_job_id
    from contract.redis.clock import now as service_now
    from contract.settings.config import load_settings

    config = workdir / "config.yaml"
    config.write_text(f"redis_url: {redis_url}\nnamespace: bench-reads\n")
    settings = load_settings(config)
    app = create_app(settings)
    store, client = services(app).store, app.test_client()
    rows = []
    try:
        for detections in SIZES:
            job_id = new_job_id()
            document = result_document(detections)
            store_job(redis.Redis.from_url(redis_url), store.keys, finished_job(job_id, document, service_now()))
            compact = json.dumps(document, separators=(",", ":"))
            row: dict[str, Any] = {"detections": detections, "stored_bytes": len(compact)}
            for name, as_text in (("parsed_ms", ()), ("as_stored_ms", ("result",))):
                store.as_text = as_text
                bodies = {client.get(f"/v1/jobs/{job_id}").data for _ in range(3)}  # warm, and one answer
                runs = []
                for _ in range(REPEATS):  # the least of several: other processes on the machine only add
                    started = time.process_time()
                    for _ in range(reads):
                        assert client.get(f"/v1/jobs/{job_id}").status_code == 200
                    runs.append((time.process_time() - started) * 1000.0 / reads)
                row[name] = min(runs)
                row[name.replace("_ms", "_body")] = bodies
            row["same_body"] = row.pop("parsed_body") == row.pop("as_stored_body")
            rows.append(row)
    finally:
        services(app).listener.close()
    return rows


def describe(reads: int) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-reads-") as folder:
        server = RedisServer(Path(folder))
        try:
            rows = measure(server.url, reads, Path(folder))
        finally:
            server.stop()
    lines = [
        f"API CPU per GET /v1/jobs/<id> of a succeeded job, in-process (Flask test client, time.process_time, "
        f"the least of {REPEATS} x {reads} reads)",
        "",
        "| detections | result bytes | parsed and validated (before) ms | served as stored ms | same body |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['detections']} | {row['stored_bytes']} | {row['parsed_ms']:.2f} | {row['as_stored_ms']:.2f} | "
            f"{'yes' if row['same_body'] else 'NO'} |"
        )
    return "\n".join(lines)
