"""The decode floor: the CPU one thread needs to turn an upload into a model input, and how the whole
stack's CPU per image compares with it.

The floor is the least work the service cannot avoid: Pillow-SIMD decoding a JPEG with DCT scaling
(draft mode) to the smallest scale whose long side still reaches the input size, a bilinear resize to
it and a letterbox onto the square canvas. No HTTP, no queue, no Redis, no Python around it. Measured
in the bench's own process, one thread, on the images the run sent, right after the run: the ratio of
the stack's CPU per image (every process, Redis included) to it is the overhead the stack adds.
"""

from __future__ import annotations

import io
import math
import statistics
import time
from collections.abc import Mapping
from typing import Any

from PIL import Image, ImageFile

PAD = (114, 114, 114)


def prepare(data: bytes, size: int) -> bytes:
    """One image to its letterboxed size x size RGB canvas, as cheaply as Pillow-SIMD allows."""
    image: Image.Image = Image.open(io.BytesIO(data))
    width, height = image.size
    ratio = size / max(width, height)
    if image.format == "JPEG" and ratio < 1.0 and isinstance(image, ImageFile.ImageFile):
        image.draft("RGB", (math.ceil(width * ratio), math.ceil(height * ratio)))
    image.load()
    if image.mode != "RGB":
        image = image.convert("RGB")
    new_w, new_h = max(1, round(width * ratio)), max(1, round(height * ratio))
    if image.size != (new_w, new_h):
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    canvas = Image.new("RGB", (size, size), PAD)
    canvas.paste(image, ((size - new_w) // 2, (size - new_h) // 2))
    return canvas.tobytes()


def decode_floor_ms(images: list[bytes], size: int = 320, passes: int = 3) -> float:
    """CPU milliseconds per image of `prepare`, on this thread: the median of `passes` passes over the images
    (a pass disturbed by another process's burst does not set the figure)."""
    if not images:
        raise ValueError("no images to measure the decode floor on")
    prepare(images[0], size)  # imports and first-call costs stay out of the figure
    per_pass = []
    for _ in range(passes):
        started = time.thread_time()
        for data in images:
            prepare(data, size)
        per_pass.append((time.thread_time() - started) * 1000.0 / len(images))
    return round(statistics.median(per_pass), 3)


def against_floor(cpu_ms: Mapping[str, float], floor_ms: float) -> dict[str, Any]:
    """The run's CPU per image against the floor, and the capacity it implies.

    `cpu_ms` is bench.stack.cpu.ms_per_image's table: `stack` is every process of the deployment (Redis
    included, the load generator not). Cores per 1,000 images/s is the stack's CPU ms per image (1,000
    images/s x N ms = N CPU-seconds a second); one Redis core carries 1,000 / Redis's ms images/s, by
    its main thread's CPU where that was read (the thread that runs every command).
    """
    stack, redis_ms = cpu_ms.get("stack"), cpu_ms.get("redis-main", cpu_ms.get("redis"))
    figures: dict[str, Any] = {"decode_floor_ms": floor_ms}
    if stack:
        figures["stack_over_floor"] = round(stack / floor_ms, 2) if floor_ms > 0 else None
        figures["cores_per_1000_images_s"] = round(stack, 1)
    if redis_ms:
        figures["images_s_per_redis_core"] = round(1000.0 / redis_ms)
    return figures


def describe(figures: Mapping[str, Any]) -> str:
    """One line: the ratio to the floor and the capacity line."""
    parts = [f"decode floor {figures['decode_floor_ms']:.2f} ms/image (one thread, same images)"]
    if figures.get("stack_over_floor") is not None:
        parts.append(f"stack / floor {figures['stack_over_floor']:.2f}x")
    if figures.get("cores_per_1000_images_s") is not None:
        parts.append(f"{figures['cores_per_1000_images_s']:.1f} cores per 1,000 images/s")
    if figures.get("images_s_per_redis_core") is not None:
        parts.append(f"one Redis core carries {figures['images_s_per_redis_core']:,} images/s")
    return "; ".join(parts)
