"""Synthetic shapes scenes with exact boxes: the default model's training and
evaluation data. Circles, squares and triangles in several colours and sizes,
rotated, overlapping a little, on noisy and textured backgrounds, in images of
many sizes and aspect ratios. No torch: the bench and tests use it too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

LABELS = ("circle", "square", "triangle")
PALETTE = (
    (230, 40, 40),
    (40, 180, 60),
    (40, 80, 230),
    (245, 200, 30),
    (240, 120, 20),
    (150, 60, 200),
    (30, 200, 210),
    (250, 250, 250),
    (20, 20, 20),
    (240, 90, 170),
)


@dataclass(frozen=True)
class SceneSettings:
    min_side: int = 160
    max_side: int = 1600
    max_aspect: float = 2.6
    min_objects: int = 1
    max_objects: int = 6
    min_object_frac: float = 0.07  # object size as a fraction of the image's short side
    max_object_frac: float = 0.45
    max_overlap_iou: float = 0.15


@dataclass
class Scene:
    image: Image.Image
    boxes: list[tuple[float, float, float, float]] = field(default_factory=list)  # x1, y1, x2, y2
    classes: list[int] = field(default_factory=list)


def generate_scene(
    rng: random.Random, settings: SceneSettings = SceneSettings(), size: tuple[int, int] | None = None
) -> Scene:
    width, height = size or _random_size(rng, settings)
    image = _background(rng, width, height)
    draw = ImageDraw.Draw(image)
    scene = Scene(image=image)
    colours: list[tuple[int, int, int]] = []
    wanted = rng.randint(settings.min_objects, settings.max_objects)
    for class_id, box, polygon in _placed(scene, wanted, settings, lambda: _place_shape(rng, width, height, settings)):
        touching = {colour for colour, other in zip(colours, scene.boxes) if _iou(box, other) > 0}
        colour = _contrasting_colour(rng, image, box, avoid=touching)
        colours.append(colour)
        if class_id == 0:
            draw.ellipse(box, fill=colour)
        else:
            draw.polygon(polygon, fill=colour)
    return scene


def _placed(
    scene: Scene, wanted: int, settings: SceneSettings, propose: Callable[[], Any]
) -> Iterator[tuple[int, Any, Any]]:
    """Up to `wanted` shapes from `propose` (class id, box, polygon; None: nothing fits), each kept only if
    it overlaps no earlier one by more than max_overlap_iou, at most 8 tries a shape. The caller draws each
    one it is given; the scene records it when the caller asks for the next."""
    for _ in range(wanted * 8):
        if len(scene.boxes) >= wanted:
            break
        candidate = propose()
        if candidate is None or any(_iou(candidate[1], box) > settings.max_overlap_iou for box in scene.boxes):
            continue
        yield candidate
        scene.boxes.append(candidate[1])
        scene.classes.append(candidate[0])


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
        points = _rotated(
            [(math.cos(a), math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)],
            rng.uniform(0, 2 * math.pi),
        )
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = size / max(max(xs) - min(xs), max(ys) - min(ys))
    polygon = [(cx + x * scale, cy + y * scale) for x, y in points]
    box = (
        min(p[0] for p in polygon),
        min(p[1] for p in polygon),
        max(p[0] for p in polygon),
        max(p[1] for p in polygon),
    )
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


# --- domain randomisation: the default model's training scenes ----------------------------------
@dataclass(frozen=True)
class RandomisedSettings(SceneSettings):
    """Scenes for training, randomised along every axis a user's image may differ in."""

    max_side: int = 800
    max_objects: int = 7
    min_object_frac: float = 0.03  # of the short side
    max_object_frac: float = 0.60
    min_contrast: float = 14.0  # CIE76 delta E between a shape and the background under it


def randomised_scene(
    rng: random.Random, settings: RandomisedSettings = RandomisedSettings(), size: tuple[int, int] | None = None
) -> Scene:
    """Any colour with enough contrast (drawn in CIELAB), flat, noisy, graded or busy backgrounds,
    fills and outlines, 3-60% of the short side, upright and turned, several triangle shapes,
    aliased or anti-aliased edges, touching neighbours; then blur, noise and JPEG at quality 30-95."""
    width, height = size or _random_size(rng, settings)
    image = _randomised_background(rng, width, height)
    scene = Scene(image=image)
    colours: list[np.ndarray] = []
    wanted = rng.randint(settings.min_objects, settings.max_objects)
    smooth = rng.random() < 0.5
    for class_id, box, polygon in _placed(
        scene, wanted, settings, lambda: _randomised_shape(rng, width, height, settings)
    ):
        touching = [
            colour for colour, other in zip(colours, scene.boxes) if _iou(box, other) > 0 or _gap(box, other) < 3
        ]
        colour = _colour_with_contrast(rng, image, box, touching, settings.min_contrast)
        outline = rng.random() < 0.15
        _draw(image, class_id, box, polygon, tuple(int(v) for v in colour), outline, smooth, rng)
        colours.append(colour)
    scene.image = _degraded(rng, image)
    return scene


def _randomised_background(rng: random.Random, width: int, height: int) -> Image.Image:
    kind = rng.random()
    if kind < 0.3:
        return _background(rng, width, height)  # busy: the original scenes
    np_rng = np.random.default_rng(rng.getrandbits(32))
    first = _lab_to_rgb(np_rng.uniform([10, -60, -60], [95, 60, 60]))
    if kind < 0.75:  # flat, maybe lightly noisy
        pixels = np.broadcast_to(first, (height, width, 3)).astype(np.float32)
    else:  # a soft gradient
        second = np.clip(first + np_rng.normal(0, 25, 3), 0, 255)
        t = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
        pixels = np.broadcast_to(first * (1 - t) + second * t, (height, width, 3)).astype(np.float32)
    if rng.random() < 0.5:
        pixels = pixels + np_rng.normal(0, rng.uniform(1, 6), (height, width, 1)).astype(np.float32)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def _randomised_shape(rng: random.Random, width: int, height: int, settings: RandomisedSettings):
    short = min(width, height)
    # Uniform in the square root: small objects more often than large, but not mostly specks.
    low, high = math.sqrt(settings.min_object_frac), math.sqrt(settings.max_object_frac)
    size = rng.uniform(low, high) ** 2 * short
    size = max(size, 8.0)
    cx, cy = rng.uniform(size / 2, width - size / 2), rng.uniform(size / 2, height - size / 2)
    class_id = rng.randrange(len(LABELS))
    if class_id == 0:
        r = size / 2
        return 0, (cx - r, cy - r, cx + r, cy + r), None
    if class_id == 1:
        angle = 0.0 if rng.random() < 0.4 else rng.uniform(0, math.pi / 2)
        points = _rotated([(-1, -1), (1, -1), (1, 1), (-1, 1)], angle)
    else:
        points = _triangle(rng)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = size / max(max(xs) - min(xs), max(ys) - min(ys))
    mid_x, mid_y = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
    polygon = [(cx + (x - mid_x) * scale, cy + (y - mid_y) * scale) for x, y in points]
    box = (
        min(p[0] for p in polygon),
        min(p[1] for p in polygon),
        max(p[0] for p in polygon),
        max(p[1] for p in polygon),
    )
    if box[0] < 0 or box[1] < 0 or box[2] > width or box[3] > height:
        return None
    return class_id, box, polygon


def _triangle(rng: random.Random):
    """Equilateral, isosceles (apex 40-100 degrees) or right-angled; upright, upside down or turned."""
    kind = rng.random()
    if kind < 0.5:
        points = [(math.cos(a), math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    elif kind < 0.8:
        half = math.radians(rng.uniform(40, 100)) / 2
        points = [(0.0, -1.0), (math.tan(half) * 2, 1.0), (-math.tan(half) * 2, 1.0)]
    else:
        points = [(-1.0, -1.0), (-1.0, 1.0), (rng.uniform(0.2, 1.5), 1.0)]
    turn = rng.random()
    angle = 0.0 if turn < 0.35 else math.pi if turn < 0.45 else rng.uniform(0, 2 * math.pi)
    return _rotated(points, angle)


def _draw(
    image: Image.Image, class_id: int, box, polygon, colour, outline: bool, smooth: bool, rng: random.Random
) -> None:
    """Filled or outlined; smooth: drawn at 4x on a mask and reduced, as a paint program anti-aliases."""
    line = max(2, int(rng.uniform(0.04, 0.12) * max(box[2] - box[0], box[3] - box[1])))
    factor = 4 if smooth else 1
    left, top = max(0, int(box[0]) - line - 2), max(0, int(box[1]) - line - 2)
    right = min(image.width, int(math.ceil(box[2])) + line + 2)
    bottom = min(image.height, int(math.ceil(box[3])) + line + 2)
    mask = Image.new("L", ((right - left) * factor, (bottom - top) * factor), 0)
    draw = ImageDraw.Draw(mask)
    shift = [((x - left) * factor, (y - top) * factor) for x, y in (polygon or [])]
    ring = {"fill": None, "outline": 255, "width": line * factor} if outline else {"fill": 255}
    if class_id == 0:
        draw.ellipse(
            ((box[0] - left) * factor, (box[1] - top) * factor, (box[2] - left) * factor, (box[3] - top) * factor),
            **ring,
        )
    elif outline:
        draw.line(shift + shift[:1], fill=255, width=line * factor, joint="curve")
    else:
        draw.polygon(shift, fill=255)
    if smooth:
        mask = mask.resize((right - left, bottom - top), Image.Resampling.LANCZOS)
    image.paste(Image.new("RGB", mask.size, colour), (left, top), mask)


def _colour_with_contrast(rng: random.Random, image: Image.Image, box, touching, min_contrast: float) -> np.ndarray:
    """A random colour in CIELAB at least `min_contrast` from the background under the shape and from
    the shapes it touches (the last of 30 tries otherwise)."""
    x1, y1, x2, y2 = (int(v) for v in box)
    patch = np.asarray(image.crop((x1, y1, max(x2, x1 + 1), max(y2, y1 + 1))).resize((4, 4)), np.float32)
    under = _rgb_to_lab(patch.reshape(-1, 3).mean(axis=0))
    others = [_rgb_to_lab(c) for c in touching]
    colour = under
    for _ in range(30):
        lab = np.array([rng.uniform(5, 97), rng.uniform(-70, 70), rng.uniform(-70, 70)])
        colour = _lab_to_rgb(lab)
        seen = _rgb_to_lab(colour)
        if np.linalg.norm(seen - under) >= min_contrast and all(
            np.linalg.norm(seen - o) >= min_contrast for o in others
        ):
            break
    return colour


def _degraded(rng: random.Random, image: Image.Image) -> Image.Image:
    if rng.random() < 0.3:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.5)))
    if rng.random() < 0.3:
        np_rng = np.random.default_rng(rng.getrandbits(32))
        noisy = np.asarray(image, np.float32) + np_rng.normal(0, rng.uniform(2, 8), (image.height, image.width, 1))
        image = Image.fromarray(noisy.clip(0, 255).astype(np.uint8), "RGB")
    if rng.random() < 0.7:
        import io

        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=rng.randint(30, 95))
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return image


def _gap(a, b) -> float:
    return max(a[0] - b[2], b[0] - a[2], a[1] - b[3], b[1] - a[3])


# sRGB (D65) <-> CIELAB, for colours picked and compared as an eye sees them.
_RGB_TO_XYZ = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
_WHITE = np.array([0.95047, 1.0, 1.08883])


def _rgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    c = np.asarray(rgb, np.float64) / 255.0
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    xyz = _RGB_TO_XYZ @ linear / _WHITE
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _lab_to_rgb(lab: np.ndarray) -> np.ndarray:
    fy = (lab[0] + 16) / 116
    f = np.array([fy + lab[1] / 500, fy, fy - lab[2] / 200])
    xyz = np.where(f > 6 / 29, f**3, 3 * (6 / 29) ** 2 * (f - 4 / 29)) * _WHITE
    linear = np.clip(np.linalg.solve(_RGB_TO_XYZ, xyz), 0, 1)
    c = np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1 / 2.4) - 0.055)
    return np.clip(c * 255.0, 0, 255)
