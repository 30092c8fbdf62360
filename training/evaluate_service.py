"""mAP@0.5 of a running deployment, measured through the full service
(HTTP -> Celery -> GPU worker), on held-out synthetic scenes of every shape:
portrait, landscape, small and large images, so the letterbox mapping is
proven end to end.

    .venv/bin/python -m training.evaluate_service --url http://localhost:8000 --images 200
    .venv/bin/python -m training.evaluate_service --generator independent   # scenes training never saw
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from contract.jobs.record import TERMINAL
from training.independent import independent_scene
from training.metrics import ImagePredictions, ImageTruth, box_iou, mean_average_precision
from training.synth import LABELS, Scene, generate_scene

# (name, size or None for random) - each held-out image gets one in turn.
CATEGORIES = (
    ("landscape", (1280, 720)),
    ("portrait", (720, 1280)),
    ("small", (240, 180)),
    ("large", (2400, 1600)),
    ("random", None),
)


@dataclass
class Report:
    map50: float
    per_class: dict[str, float]
    per_category: dict[str, float]
    images: int
    objects: int
    recall_iou80: float  # objects matched by a same-class detection with IoU >= 0.8
    failures: int

    def lines(self) -> list[str]:
        rows = [
            f"mAP@0.5 {self.map50:.4f} over {self.images} images, {self.objects} objects (through the service)",
            "per class: " + ", ".join(f"{k} {v:.3f}" for k, v in self.per_class.items()),
            "per image kind: " + ", ".join(f"{k} {v:.3f}" for k, v in self.per_category.items()),
            f"objects found with IoU >= 0.8: {self.recall_iou80:.3f}; failed jobs: {self.failures}",
        ]
        return rows


def held_out_scenes(count: int, seed: int = 20_000, generator: str = "synth") -> list[tuple[str, Scene]]:
    """`synth`: the original generator's scenes in each category of size; `independent`: scenes from
    training/independent.py, a generator the model never trained on (its own sizes, 640x480 to 1080p)."""
    scenes = []
    for i in range(count):
        if generator == "independent":
            scene = independent_scene(random.Random(seed + i))
            scenes.append(("portrait" if scene.image.height > scene.image.width else "landscape", scene))
            continue
        name, size = CATEGORIES[i % len(CATEGORIES)]
        scenes.append((name, generate_scene(random.Random(seed + i), size=size)))
    return scenes


def encode_jpeg(scene: Scene, quality: int = 92) -> bytes:
    buffer = io.BytesIO()
    scene.image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def detect(session: requests.Session, url: str, data: bytes, conf: float, timeout_s: float = 120.0) -> dict:
    response = session.post(
        f"{url}/v1/jobs", files={"image": ("scene.jpg", data, "image/jpeg")}, data={"conf": str(conf)}, timeout=30
    )
    response.raise_for_status()
    job_id = response.json()["id"]
    for _ in range(int(timeout_s / 10) + 1):
        doc = session.get(f"{url}/v1/jobs/{job_id}", params={"wait": 10}, timeout=40).json()
        if doc["status"] in TERMINAL:
            return doc
    return doc


def evaluate_service(url: str, scenes: list[tuple[str, Scene]], conf: float = 0.05, concurrency: int = 8) -> Report:
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=concurrency)
    session.mount("http://", adapter)
    with ThreadPoolExecutor(concurrency) as pool:
        docs = list(pool.map(lambda item: detect(session, url, encode_jpeg(item[1]), conf), scenes))
    truths = [ImageTruth(scene.boxes, scene.classes) for _, scene in scenes]
    predictions = [_predictions(doc) for doc in docs]
    map50, per_class = mean_average_precision(truths, predictions, len(LABELS))
    per_category = {}
    for name, _ in CATEGORIES:
        picked = [i for i, (kind, _) in enumerate(scenes) if kind == name]
        if picked:
            per_category[name] = mean_average_precision(
                [truths[i] for i in picked], [predictions[i] for i in picked], len(LABELS)
            )[0]
    return Report(
        map50=map50,
        per_class={LABELS[c]: v for c, v in per_class.items()},
        per_category=per_category,
        images=len(scenes),
        objects=sum(len(t.boxes) for t in truths),
        recall_iou80=_recall_at(truths, predictions, 0.8),
        failures=sum(doc["status"] != "succeeded" for doc in docs),
    )


def _predictions(doc: dict) -> ImagePredictions:
    detections = (doc.get("result") or {}).get("detections", [])
    return ImagePredictions(
        [d["box"] for d in detections], [d["score"] for d in detections], [d["class_id"] for d in detections]
    )


def _recall_at(
    truths: list[ImageTruth], predictions: list[ImagePredictions], threshold: float, min_score: float = 0.3
) -> float:
    found = total = 0
    for truth, pred in zip(truths, predictions):
        for box, cls in zip(truth.boxes, truth.classes):
            total += 1
            found += any(
                c == cls and s >= min_score and box_iou(box, b) >= threshold
                for b, s, c in zip(pred.boxes, pred.scores, pred.classes)
            )
    return found / total if total else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--min-map", type=float, default=0.0, help="exit 1 below this mAP")
    parser.add_argument(
        "--generator",
        choices=("synth", "independent"),
        default="synth",
        help="synth: the training generator's family; independent: training/independent.py",
    )
    args = parser.parse_args(argv)
    scenes = held_out_scenes(args.images, args.seed, args.generator)
    report = evaluate_service(args.url, scenes, concurrency=args.concurrency)
    print("\n".join(report.lines()))
    return 0 if report.map50 >= args.min_map else 1


if __name__ == "__main__":
    sys.exit(main())
