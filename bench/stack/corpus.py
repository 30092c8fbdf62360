"""The bench's images: photo-like 1920x1080 JPEGs of 300 KB to 1 MB, generated
once from a seed and cached, or the JPEGs/PNGs of a folder the user names."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from training.synth import generate_scene

DEFAULT_CACHE = Path(".bench") / "corpus"
SIZE = (1920, 1080)


def photo_like_jpeg(seed: int, size: tuple[int, int] = SIZE) -> bytes:
    """A shapes scene with fine grain and texture, so it compresses like a photo."""
    rng = random.Random(seed)
    scene = generate_scene(rng, size=size)
    np_rng = np.random.default_rng(seed)
    texture = Image.fromarray(np_rng.integers(0, 255, (size[1] // 4, size[0] // 4, 3), dtype=np.uint8))
    texture = texture.resize(size, Image.Resampling.BILINEAR).filter(ImageFilter.GaussianBlur(1.2))
    blended = Image.blend(scene.image, texture, rng.uniform(0.12, 0.22))
    grain = np_rng.normal(0, rng.uniform(4, 9), (size[1], size[0], 1)).astype(np.float32)
    pixels = (np.asarray(blended, np.float32) + grain).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=rng.choice((85, 88, 90, 92)))
    return buffer.getvalue()


def load_corpus(folder: Path | None = None, count: int = 24, seed: int = 7, cache: Path = DEFAULT_CACHE) -> list[bytes]:
    """The named folder's images, or `count` generated JPEGs (cached by seed)."""
    if folder is not None:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"))
        if not files:
            raise SystemExit(f"no images in {folder}")
        return [p.read_bytes() for p in files]
    cache.mkdir(parents=True, exist_ok=True)
    images = []
    for i in range(count):
        path = cache / f"photo-{seed}-{i:03d}.jpg"
        if not path.exists():
            path.write_bytes(photo_like_jpeg(seed * 1000 + i))
        images.append(path.read_bytes())
    return images
