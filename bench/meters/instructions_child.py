"""What `bench instructions --role cpu-task` runs under callgrind, by path, with the measured checkout first on
sys.path (its contract and tasks, not this checkout's):

    python bench/meters/instructions_child.py ROOT REDIS_URL WORK store|task|decode COUNT

store: COUNT jobs (plus the warm-up's) stored as the API stores them, outside the count; task: that many
Preprocessor.run calls after the warm-up; decode: decode + letterbox alone, as many times, on the same images.
"""

import os
import sys
import time
from pathlib import Path

WARM_UP = 5

if __name__ == "__main__":
    root, redis_url, work, mode, count = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    sys.path.insert(0, root)
    config = work / "config.yaml"
    config.write_text(f"redis_url: {redis_url}\n")
    os.environ["IMGSERVE_CONFIG"] = str(config)

    import importlib

    try:  # the measured checkout's, by either of their paths (--base may predate contract's packages)
        from contract.redis.connection import connect
        from contract.redis.keys import Keys
        from contract.settings.config import load_settings
    except ModuleNotFoundError:
        connect = importlib.import_module("contract.connection").connect
        Keys = importlib.import_module("contract.keys").Keys  # type: ignore[misc]
        load_settings = importlib.import_module("contract.config").load_settings

    try:  # the measured checkout's CPU stage, by either of its paths (--base may predate tasks/'s parts)
        from tasks.decoding.imaging import decode_image, letterbox
        from tasks.decoding.preprocess import Preprocessor
    except ModuleNotFoundError:
        from tasks.imaging import decode_image, letterbox  # type: ignore[no-redef]
        from tasks.preprocess import Preprocessor  # type: ignore[no-redef]

    settings = load_settings()
    client = connect(settings, socket_timeout=60.0)
    images = [path.read_bytes() for path in sorted(work.glob("image-*.jpg"))]
    preprocessor = Preprocessor(settings, client)
    spec = preprocessor.catalogue.default
    ids = [f"{index:032x}" for index in range(WARM_UP + count)]
    if mode == "store":
        try:  # the measured checkout's API side of the job store, by either of its names (--base may predate it)
            store_class = importlib.import_module("contract.jobs.intake").JobIntake
        except ModuleNotFoundError:
            store_class = importlib.import_module("contract.jobs").JobStore
        store = store_class(client, Keys(settings.namespace), settings.jobs.ttl_s)
        for index, job_id in enumerate(ids):
            image, now = images[index % len(images)], time.time()
            store.create(
                job_id,
                image,
                3600,
                {
                    "model": spec.key,
                    "received_at": now,
                    "submitted_at": now,
                    "deadline_at": now + 3600,
                    "options": {},
                    "media_type": "image/jpeg",
                    "bytes": len(image),
                },
            )
        sys.exit(0)
    limits = settings.decode
    frames = Keys(settings.namespace).frames(spec.key)
    for index, job_id in enumerate(ids):
        if mode == "task":
            outcome = preprocessor.run(job_id)
            if outcome != "pushed":
                raise SystemExit(f"task {job_id}: {outcome}")
            if index % 16 == 15:
                client.delete(frames)  # the list stays short of its bound (no GPU worker drains it)
        else:
            decoded, size = decode_image(
                images[index % len(images)],
                spec.input_size,
                limits.max_image_pixels,
                limits.max_decoded_bytes,
                limits.max_scans,
                limits.max_pixel_scans,
            )
            letterbox(decoded, size, spec.input_size)
