"""Synthetic shapes scenes with exact boxes: the default model's training and
evaluation data. Circles, squares and triangles in several colours and sizes,
rotated, overlapping a little, on noisy and textured backgrounds, in images of
many sizes and aspect ratios. No torch: the bench and tests use it too.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

LABELS = ("circle", "square", "triangle")
PALETTE = ((230, 40, 40), (40, 180, 60), (40, 80, 230), (245, 200, 30), (240, 120, 20),
           (150, 60, 200), (30, 200, 210), (250, 250, 250), (20, 20, 20), (240, 90, 170))


@dataclass(frozen=True)
class SceneSettings:
    min_side: int = 160
    max_side: int = 1600
    max_aspect: float = 2.6
    min_objects: int = 1
    max_objects: int = 6
    min_object_frac: float = 0.07     # object size as a fraction of the image's short side
    max_object_frac: float = 0.45
    max_overlap_iou: float = 0.15


@dataclass
class Scene:
    image: Image.Image
    boxes: list[tuple[float, float, float, float]] = field(default_factory=list)   # x1, y1, x2, y2
    classes: list[int] = field(default_factory=list)


def generate_scene(rng: random.Random, settings: SceneSettings = SceneSettings(),
                   size: tuple[int, int] | None = None) -> Scene:
    width, height = size or _random_size(rng, settings)
    image = _background(rng, width, height)
    draw = ImageDraw.Draw(image)
    scene = Scene(image=image)
    colours: list[tuple[int, int, int]] = []
    wanted = rng.randint(settings.min_objects, settings.max_objects)
    for _ in range(wanted * 8):
        if len(scene.boxes) >= wanted:
            break
        candidate = _place_shape(rng, width, height, settings)
        if candidate is None or any(_iou(candidate[1], box) > settings.max_overlap_iou for box in scene.boxes):
            continue
        class_id, box, polygon = candidate
        touching = {colour for colour, other in zip(colours, scene.boxes) if _iou(box, other) > 0}
        colour = _contrasting_colour(rng, image, box, avoid=touching)
        colours.append(colour)
        if class_id == 0:
            draw.ellipse(box, fill=colour)
        else:
            draw.polygon(polygon, fill=colour)
        scene.boxes.append(box)
        scene.classes.append(class_id)
    return scene


def _random_size(rng: random.Random, settings: SceneSettings) -> tuple[int, int]:
    long_side = int(math.exp(rng.uniform(math.log(settings.min_side * 1.5), math.log(settings.max_side))))
    aspect = math.exp(rng.uniform(0, math.log(settings.max_aspect)))
    short_side = max(settings.min_side, int(long_side / aspect))
    return (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)


def _background(rng: random.Random, width: int, height: int) -> Image.Image:
    """A gradient, plus stripes or blotches, plus noise: never a flat colour."""
    np_rng = np.random.default_rng(rng.getrandbits(32))
    a, b = np_rng.uniform(40, 215, 3), np_rng.uniform(40, 215, 3)
    t = np.linspace(0.0, 1.0, width if rng.random() < 0.5 else height, dtype=np.float32)
    ramp = a[None, :] * (1 - t[:, None]) + b[None, :] * t[:, None]
    if len(t) == width:
        base = np.broadcast_to(ramp[None, :, :], (height, width, 3))
    else:
        base = np.broadcast_to(ramp[:, None, :], (height, width, 3))
    image = Image.fromarray(base.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(0, 12)):
        tone = tuple(int(v) for v in np_rng.uniform(30, 225, 3))
        if rng.random() < 0.5:
            x = rng.uniform(-width, width)
            draw.line((x, 0, x + rng.uniform(-width, width), height), fill=tone, width=rng.randint(1, 6))
        else:
            cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(5, 0.5 * min(width, height))
            draw.ellipse((cx - r, cy - 0.6 * r, cx + r, cy + 0.6 * r), fill=tone)
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(2, 8)))
    noise = np_rng.normal(0, rng.uniform(2, 14), (height, width, 1)).astype(np.float32)
    pixels = np.asarray(image, dtype=np.float32) + noise
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def _place_shape(rng: random.Random, width: int, height: int, settings: SceneSettings):
    short = min(width, height)
    size = rng.uniform(settings.min_object_frac, settings.max_object_frac) * short
    cx, cy = rng.uniform(size / 2, width - size / 2), rng.uniform(size / 2, height - size / 2)
    class_id = rng.randrange(len(LABELS))
    if class_id == 0:
        r = size / 2
        return 0, (cx - r, cy - r, cx + r, cy + r), None
    if class_id == 1:
        points = _rotated([(-1, -1), (1, -1), (1, 1), (-1, 1)], rng.uniform(0, math.pi / 2))
    else:
        points = _rotated([(math.cos(a), math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)],
                          rng.uniform(0, 2 * math.pi))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = size / max(max(xs) - min(xs), max(ys) - min(ys))
    polygon = [(cx + x * scale, cy + y * scale) for x, y in points]
    box = (min(p[0] for p in polygon), min(p[1] for p in polygon),
           max(p[0] for p in polygon), max(p[1] for p in polygon))
    if box[0] < 0 or box[1] < 0 or box[2] > width or box[3] > height:
        return None
    return class_id, box, polygon


def _rotated(points, angle: float):
    c, s = math.cos(angle), math.sin(angle)
    return [(x * c - y * s, x * s + y * c) for x, y in points]


def _contrasting_colour(rng: random.Random, image: Image.Image, box, avoid=frozenset()) -> tuple[int, int, int]:
    """A palette colour far enough from the background under the shape to be seen,
    and unlike the shapes it touches (same-colour neighbours would merge)."""
    x1, y1, x2, y2 = (int(v) for v in box)
    patch = np.asarray(image.crop((x1, y1, max(x2, x1 + 1), max(y2, y1 + 1))).resize((4, 4)), np.float32)
    mean = patch.reshape(-1, 3).mean(axis=0)
    choices = [c for c in PALETTE if np.abs(np.array(c) - mean).sum() > 150 and c not in avoid]
    choices = choices or [c for c in PALETTE if c not in avoid]
    return rng.choice(choices)


def _iou(a, b) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0
