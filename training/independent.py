"""A second scene generator for evaluation only, written apart from `training.synth`.

It shares no drawing code or colour logic with the training generator, so a
model that learned `synth`'s habits (its palette, its busy backgrounds, its
aliased edges) rather than the shapes scores badly here:

- plain single-colour backgrounds, some with light noise, none textured;
- solid shapes in muted colours (HSV saturation 0.15-0.6) whose brightness is
  close to the background's, at a contrast just above what an eye needs;
- upright triangles and axis-aligned squares (a quarter of them turned);
- anti-aliased: each shape is drawn at 4x on its own mask, then reduced with a
  Lanczos filter and composited, as a paint program would render it;
- 640x480 to 1920x1080, landscape and portrait, objects 5-40% of the short side.
"""

from __future__ import annotations

import colorsys
import math
import random

import numpy as np
from PIL import Image, ImageDraw

from training.synth import LABELS, Scene

SUPERSAMPLE = 4
SIZES = ((640, 480), (800, 600), (1024, 768), (1280, 720), (1600, 900), (1920, 1080))


def independent_scene(rng: random.Random) -> Scene:
    width, height = rng.choice(SIZES)
    if rng.random() < 0.25:
        width, height = height, width
    hue, background_value = rng.random(), rng.uniform(0.25, 0.85)
    background = _hsv(hue, rng.uniform(0.0, 0.5), background_value)
    canvas = np.empty((height, width, 3), np.float32)
    canvas[:] = background
    boxes: list[tuple[float, float, float, float]] = []
    classes: list[int] = []
    wanted = rng.randint(1, 6)
    for _ in range(wanted * 10):
        if len(boxes) == wanted:
            break
        class_id = rng.randrange(len(LABELS))
        side = rng.uniform(0.05, 0.40) * min(width, height)
        x, y = rng.uniform(0, width - side), rng.uniform(0, height - side)
        outline = _outline(class_id, x, y, side, turned=rng.random() < 0.25, rng=rng)
        box = _bounds(outline) if class_id else (x, y, x + side, y + side)
        if box[0] < 0 or box[1] < 0 or box[2] > width or box[3] > height:
            continue
        if any(_overlaps(box, other) for other in boxes):
            continue
        colour = _muted_colour_near(rng, background_value)
        _paint(canvas, class_id, outline if class_id else (x, y, x + side, y + side), colour)
        boxes.append(box)
        classes.append(class_id)
    if rng.random() < 0.5:
        canvas += np.random.default_rng(rng.getrandbits(32)).normal(0, rng.uniform(1, 5), canvas.shape[:2] + (1,))
    image = Image.fromarray(canvas.clip(0, 255).round().astype(np.uint8), "RGB")
    return Scene(image=image, boxes=boxes, classes=classes)


def _hsv(hue: float, saturation: float, value: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(hue, saturation, value), np.float32) * 255.0


def _muted_colour_near(rng: random.Random, background_value: float) -> np.ndarray:
    """Low saturation, brightness 0.12-0.3 away from the background's (up or down, as room allows)."""
    step = rng.uniform(0.12, 0.30)
    value = (
        background_value + step
        if (background_value + step <= 1.0 and rng.random() < 0.5) or background_value - step < 0.05
        else background_value - step
    )
    return _hsv(rng.random(), rng.uniform(0.15, 0.6), min(1.0, max(0.0, value)))


def _outline(class_id: int, x: float, y: float, side: float, turned: bool, rng: random.Random):
    """A square's or triangle's corners (a circle needs none), upright unless turned."""
    cx, cy = x + side / 2, y + side / 2
    if class_id == 1:
        corners = [(-0.5, -0.5), (0.5, -0.5), (0.5, 0.5), (-0.5, 0.5)]
    elif class_id == 2:
        corners = [(0.0, -0.5), (0.5, 0.5), (-0.5, 0.5)]  # apex up, base down
    else:
        return None
    angle = rng.uniform(0, 2 * math.pi) if turned else 0.0
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + side * (u * c - v * s), cy + side * (u * s + v * c)) for u, v in corners]


def _bounds(points) -> tuple[float, float, float, float]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return min(xs), min(ys), max(xs), max(ys)


def _overlaps(a, b, gap: float = 4.0) -> bool:
    return not (a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1])


def _paint(canvas: np.ndarray, class_id: int, geometry, colour: np.ndarray) -> None:
    """Draw the shape's coverage at 4x on a mask around it, reduce it (Lanczos), blend the colour by it."""
    x1, y1, x2, y2 = geometry if class_id == 0 else _bounds(geometry)
    left, top = max(0, int(x1) - 2), max(0, int(y1) - 2)
    right, bottom = min(canvas.shape[1], int(math.ceil(x2)) + 2), min(canvas.shape[0], int(math.ceil(y2)) + 2)
    mask = Image.new("L", ((right - left) * SUPERSAMPLE, (bottom - top) * SUPERSAMPLE), 0)
    draw = ImageDraw.Draw(mask)

    def scaled(px: float, py: float) -> tuple[float, float]:
        return (px - left) * SUPERSAMPLE, (py - top) * SUPERSAMPLE

    if class_id == 0:
        draw.ellipse((*scaled(x1, y1), *scaled(x2, y2)), fill=255)
    else:
        draw.polygon([scaled(px, py) for px, py in geometry], fill=255)
    reduced = mask.resize((right - left, bottom - top), Image.Resampling.LANCZOS)
    coverage = np.asarray(reduced, np.float32)[..., None] / 255.0
    region = canvas[top:bottom, left:right]
    region += (colour - region) * coverage
