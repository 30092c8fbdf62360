"""The synchronous peer issue 43 compares us with: LitServe serving the same job, decode and letterbox in its
inference workers, a batch of at most 8 within 12 ms, a simulated device, one POST per image.

Run by `bench peer` (bench.load.peer) with LitServe on the path (`make peer` installs LitServe 0.2.19 into
.peer/, apart from the service's own environment): `python -m bench.load.peer_server PORT PROFILE SIZE`. The
setup is the issue's: two inference workers on one device, one API server, `max_batch_size=8`,
`batch_timeout=0.012`. Each worker's work per image is the decode floor's (bench.meters.floor.prepare: the least
the job allows), and its device is what ours is in the `sim` profile: a sleep of the profile's latency for
the batch's size, after the batch's host work (stacking the frames) done for real.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import litserve as ls  # type: ignore[import-not-found]  # the peer's own environment (make peer)
import numpy as np

from bench.meters.floor import prepare
from bench.stack.profiles import parse_profile
from gpu_worker.simulated import profile_latency_s

MAX_BATCH = 8
BATCH_TIMEOUT_S = 0.012
WORKERS = 2


class Detector(ls.LitAPI):  # type: ignore[misc]
    def __init__(self, profile: dict[int, float], size: int) -> None:
        super().__init__(max_batch_size=MAX_BATCH, batch_timeout=BATCH_TIMEOUT_S)
        self.profile = profile
        self.size = size

    def setup(self, device: str) -> None:
        self.device = device

    # Unannotated on purpose: LitServe reads the annotation to choose what `request` is (none: the parsed body).
    def decode_request(self, request) -> np.ndarray:  # type: ignore[no-untyped-def]
        upload = request["image"]
        data = upload.file.read() if hasattr(upload, "file") else upload
        pixels = prepare(data, self.size)
        return np.frombuffer(pixels, dtype=np.uint8).reshape(self.size, self.size, 3)

    def predict(self, batch: np.ndarray) -> list[dict[str, Any]]:
        time.sleep(profile_latency_s(self.profile, len(batch)))
        # A detection per image, of the size ours answers with (the sim model's boxes are as few).
        return [{"label": "circle", "score": 0.9, "box": [10.0, 20.0, 110.0, 120.0]} for _ in range(len(batch))]

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return {"status": "succeeded", "result": {"detections": [output]}}


def main(argv: list[str]) -> int:
    port, profile, size = int(argv[0]), parse_profile(argv[1]), int(argv[2])
    server = ls.LitServer(Detector(profile, size), accelerator="cpu", devices=1, workers_per_device=WORKERS)
    server.run(port=port, num_api_servers=1, log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
