"""Train the default shapes detector on synthetic scenes, evaluate it, export it.

    .venv/bin/python -m training.train_shapes            # ~25 min on 2 CPU cores, seed 0

Writes models/shapes-yolo.pt (TorchScript), models/shapes-yolo.md (the model
card) and configs/models/shapes-yolo.yaml (the spec the GPU worker serves).
Everything is generated here from a fixed seed: no download.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from contract.frames import MAPPING_FIELDS
from contract.settings import REPO_ROOT
from gpu_worker.postprocess import Geometry, Thresholds, postprocess
from gpu_worker.tiny_yolo import TinyYolo
from tasks.decoding.imaging import letterbox
from training.independent import independent_scene
from training.loss import detection_loss
from training.metrics import ImagePredictions, ImageTruth, mean_average_precision
from training.synth import LABELS, RandomisedSettings, SceneSettings, generate_scene, randomised_scene

PAD = 114
TRAIN_SCENES = RandomisedSettings(max_side=800)
EVAL_SCENES = SceneSettings()
# What each data set is drawn by: training's domain-randomised scenes, the original generator's held-out
# scenes, and scenes from a generator written apart (training/independent.py) that training never sees.
GENERATORS = {
    "train": lambda rng: randomised_scene(rng, TRAIN_SCENES),
    "synth": lambda rng: generate_scene(rng, EVAL_SCENES),
    "independent": independent_scene,
}


@dataclass
class TrainConfig:
    seed: int = 0
    input_size: int = 320
    width: int = 16
    train_images: int = 8000
    eval_images: int = 400
    epochs: int = 7
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 5e-4
    threads: int = 2


@dataclass
class LetterboxedScene:
    image: np.ndarray  # [S, S, 3] uint8, padded
    boxes: np.ndarray  # [M, 4] in input pixels
    classes: np.ndarray  # [M]
    orig_boxes: np.ndarray  # [M, 4] in original pixels
    geometry: tuple[float, ...]  # pad_left, pad_top, scale_x, scale_y, orig_w, orig_h


def letterbox_scene(seed: int, size: int, generator: str) -> LetterboxedScene:
    scene = GENERATORS[generator](random.Random(seed))
    letterboxed = letterbox(scene.image, scene.image.size, size)
    boxed, pixels = letterboxed.placement, letterboxed.pixels
    canvas = np.full((size, size, 3), PAD, np.uint8)
    content = np.frombuffer(pixels, np.uint8).reshape(boxed.height, boxed.width, 3)
    canvas[boxed.pad_top : boxed.pad_top + boxed.height, boxed.pad_left : boxed.pad_left + boxed.width] = content
    orig = np.array(scene.boxes, np.float32).reshape(-1, 4)
    scale = np.array([boxed.scale_x, boxed.scale_y] * 2, np.float32)
    offset = np.array([boxed.pad_left, boxed.pad_top] * 2, np.float32)
    return LetterboxedScene(
        canvas,
        orig * scale + offset,
        np.array(scene.classes, np.int64),
        orig,
        tuple(getattr(boxed, name) for name in MAPPING_FIELDS),
    )


def _make(args: tuple[int, int, str]) -> LetterboxedScene:
    return letterbox_scene(*args)


def make_dataset(count: int, seed: int, size: int, generator: str, workers: int) -> list[LetterboxedScene]:
    jobs = [(seed * 1_000_003 + i, size, generator) for i in range(count)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return list(tqdm(pool.imap(_make, jobs, chunksize=32), total=count, desc="scenes", unit="img"))


def to_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)


def flip_batch(images: torch.Tensor, targets: list, horizontal: bool, vertical: bool, size: int):
    if horizontal:
        images = images.flip(3)
        targets = [(torch.stack([size - b[:, 2], b[:, 1], size - b[:, 0], b[:, 3]], 1), c) for b, c in targets]
    if vertical:
        images = images.flip(2)
        targets = [(torch.stack([b[:, 0], size - b[:, 3], b[:, 2], size - b[:, 1]], 1), c) for b, c in targets]
    return images, targets


def build_model(config: TrainConfig) -> TinyYolo:
    torch.manual_seed(config.seed)
    model = TinyYolo(len(LABELS), width=config.width)
    prior = -math.log((1 - 0.01) / 0.01)  # start every class score near 1%
    for head in model.heads:  # type: ignore[union-attr]  # a ModuleList of Conv2d
        torch.nn.init.constant_(head.bias[4:], prior)  # type: ignore[index]
    return model


def train(model: TinyYolo, data: list[LetterboxedScene], config: TrainConfig) -> list[dict]:
    images = np.stack([d.image for d in data])
    targets = [(torch.from_numpy(d.boxes), torch.from_numpy(d.classes)) for d in data]
    steps_per_epoch = len(data) // config.batch_size
    total = steps_per_epoch * config.epochs
    optimiser = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, total // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
    )
    rng = np.random.default_rng(config.seed)
    history = []
    model.train()
    progress = tqdm(total=total, desc="train", unit="batch")
    for epoch in range(config.epochs):
        order = rng.permutation(len(data))
        for step in range(steps_per_epoch):
            index = order[step * config.batch_size : (step + 1) * config.batch_size]
            batch, batch_targets = flip_batch(
                to_tensor(images[index]),
                [targets[i] for i in index],
                bool(rng.random() < 0.5),
                bool(rng.random() < 0.5),
                config.input_size,
            )
            loss, parts = detection_loss(model.raw_outputs(batch), model.strides, batch_targets)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimiser.step()
            schedule.step()
            progress.update()
            progress.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", iou=f"{parts['iou']:.2f}")
        history.append(
            {"epoch": epoch + 1, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in parts.items()}}
        )
    progress.close()
    return history


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module, data: list[LetterboxedScene], conf: float = 0.05, iou: float = 0.5, batch_size: int = 32
) -> tuple[float, dict[int, float]]:
    """mAP@0.5 in original pixels, through the serving post-processing."""
    model.eval()
    truths, predictions = [], []
    for start in range(0, len(data), batch_size):
        chunk = data[start : start + batch_size]
        output = model(to_tensor(np.stack([d.image for d in chunk])))
        geometry = torch.tensor([d.geometry for d in chunk], dtype=torch.float64)
        n = len(chunk)
        dets = postprocess(
            output,
            "yolov8",
            Thresholds(torch.full((n,), conf), torch.full((n,), iou), torch.full((n,), 100)),
            Geometry(*(geometry[:, i] for i in range(6))),
        )
        for i, d in enumerate(chunk):
            mine = dets.image_index == i
            predictions.append(
                ImagePredictions(dets.boxes[mine].tolist(), dets.scores[mine].tolist(), dets.class_ids[mine].tolist())
            )
            truths.append(ImageTruth(d.orig_boxes.tolist(), d.classes.tolist()))
    return mean_average_precision(truths, predictions, len(LABELS))


def export(model: TinyYolo, config: TrainConfig, results: dict, out_dir: Path, spec_path: Path) -> Path:
    model.eval()
    scripted = torch.jit.script(model)
    weights = out_dir / "shapes-yolo.pt"
    scripted.save(str(weights))
    parameters = sum(p.numel() for p in model.parameters())
    spec_path.write_text(SPEC_TEMPLATE.format(input_size=config.input_size, map=results["map50"]))
    (out_dir / "shapes-yolo.md").write_text(
        CARD_TEMPLATE.format(
            parameters=parameters,
            config=json.dumps(asdict(config), indent=2),
            scenes=json.dumps({"train": asdict(TRAIN_SCENES), "eval": asdict(EVAL_SCENES)}, indent=2),
            results=json.dumps(results, indent=2),
            size_kb=weights.stat().st_size // 1024,
            input_size=config.input_size,
            **results,
        )
    )
    return weights


SPEC_TEMPLATE = """\
# The default detector: trained by `python -m training.train_shapes` on
# domain-randomised synthetic shapes (see models/shapes-yolo.md). mAP@0.5 {map:.3f} on scenes from
# a generator it never saw in training (training/independent.py).
name: shapes-yolo
version: 2.0.0
format: torchscript
path: ../../models/shapes-yolo.pt
weights: trained (domain-randomised synthetic shapes, seed 0)
input_size: {input_size}
channel_order: rgb
pad_value: 114
scale: 0.00392156862745098
mean: [0.0, 0.0, 0.0]
std: [1.0, 1.0, 1.0]
layout: yolov8
labels: [circle, square, triangle]
conf: 0.3
iou: 0.5
max_det: 100
"""

CARD_TEMPLATE = """\
# Model card: shapes-yolo 2.0.0

The default detector the service ships with. It finds **circles, squares and
triangles**, filled or outlined, drawn in any colour that stands out from
the background; it exists so that a fresh clone serves answers that are
right and checkable, with no download.

- **Architecture**: TinyYolo (`gpu_worker/tiny_yolo.py`): a 5-stage conv
  backbone (conv-BN-SiLU, residual refinements), pooled context (SPPF-style)
  on the stride-32 map, a top-down (FPN) path to the stride-16 and 8 maps, a
  conv + 1x1 anchor-free head per level, box distances through softplus,
  sigmoid class scores; the decode is inside the TorchScript graph, output
  `[B, 7, N]` (YOLOv8 layout).
- **Parameters**: {parameters:,}; file {size_kb} KB.
- **Input**: {input_size}x{input_size} RGB letterbox, pad 114, scaled by 1/255.
- **Training**: FCOS-style assignment with centre sampling, quality focal
  loss on IoU targets, GIoU box loss; AdamW, cosine schedule, flips.
  Trained on the CPU of a 2-core machine in **{train_minutes:.1f} minutes**
  (data generation included: {total_minutes:.1f} minutes end to end).
- **Data**: `training/synth.py` `randomised_scene`, generated from the seed
  (domain randomisation): any fill colour at least 14 delta E (CIELAB) from
  the background under it and from the shapes it touches; flat, noisy,
  graded and busy backgrounds; 15% outlines; sizes 3-60% of the short side;
  squares upright or turned, triangles equilateral, isosceles or right-angled,
  upright, upside down or turned; aliased or anti-aliased edges; touching
  neighbours; blur, noise and JPEG at quality 30-95; sizes and aspect ratios
  as below.
- **Evaluation**, in original pixels through the serving post-processing
  (conf 0.05, IoU 0.5), on {eval_images} scenes from each of:
  - `training/independent.py`, a generator written apart that training never
    sees (plain backgrounds, muted colours close in brightness to them,
    upright triangles, axis-aligned squares, anti-aliased, 640x480 to
    1920x1080): mAP@0.5 **{map50:.3f}**; per class: {per_class};
  - the original generator's held-out scenes (palette colours on busy
    backgrounds, up to 1600 px): mAP@0.5 **{synth_map50:.3f}**; per class:
    {synth_per_class}.
- **Can**: find these three shapes, filled or outlined, in most colours on
  plain or busy backgrounds, at 3-60% of the image's short side, turned or not.
- **Cannot**: anything else (it is not a general object detector); shapes
  whose colour is within a few delta E of the background; shapes smaller than
  ~8 input pixels (about 3% of the short side of a 16:9 image at 320); heavy
  overlaps (training keeps IoU under 0.15); ellipses, rectangles, pentagons
  are not classes and may be reported as the nearest one.

Reproduce: `.venv/bin/python -m training.train_shapes` (seed 0).

## Settings
```json
{config}
```

## Scenes
```json
{scenes}
```

## Results
```json
{results}
```
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field_name, default in asdict(TrainConfig()).items():
        parser.add_argument(f"--{field_name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "models")
    parser.add_argument("--spec", type=Path, default=REPO_ROOT / "configs" / "models" / "shapes-yolo.yaml")
    args = parser.parse_args(argv)
    config = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
    torch.set_num_threads(config.threads)
    started = time.time()
    train_data = make_dataset(config.train_images, config.seed, config.input_size, "train", config.threads)
    eval_sets = {
        name: make_dataset(config.eval_images, config.seed + 10_000, config.input_size, name, config.threads)
        for name in ("independent", "synth")
    }
    model = build_model(config)
    train_started = time.time()
    history = train(model, train_data, config)
    train_minutes = (time.time() - train_started) / 60
    scores = {name: evaluate(model, data) for name, data in eval_sets.items()}
    map50, per_class = scores["independent"]
    results = {
        "map50": round(map50, 4),
        "per_class": {LABELS[c]: round(v, 4) for c, v in per_class.items()},
        "synth_map50": round(scores["synth"][0], 4),
        "synth_per_class": {LABELS[c]: round(v, 4) for c, v in scores["synth"][1].items()},
        "eval_images": config.eval_images,
        "train_minutes": round(train_minutes, 2),
        "total_minutes": round((time.time() - started) / 60, 2),
        "history": history,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    weights = export(model, config, results, args.out, args.spec)
    print(
        f"mAP@0.5 independent {map50:.4f} {results['per_class']}, synth {results['synth_map50']:.4f} "
        f"-> {weights} ({results['total_minutes']} min)"
    )


if __name__ == "__main__":
    main()
