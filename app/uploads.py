"""Validating a submission: the image bytes and the per-job options. Pure functions."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from app.problems import Problem

# Magic numbers of the image types we accept, checked on the bytes themselves.
_SIGNATURES = (
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"BM", "image/bmp"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
ACCEPTED_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp", "image/gif")


@dataclass(frozen=True)
class Options:
    conf: float | None = None
    iou: float | None = None
    max_det: int | None = None
    deadline_ms: int | None = None

    def for_model(self) -> dict[str, Any]:
        """The options the GPU worker applies; unset ones fall back to the model's defaults."""
        return {k: v for k, v in (("conf", self.conf), ("iou", self.iou), ("max_det", self.max_det))
                if v is not None}


def sniff_image_type(data: bytes) -> str | None:
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for signature, media_type in _SIGNATURES:
        if data.startswith(signature):
            return media_type
    return None


def check_image(data: bytes, declared_type: str | None) -> str:
    """The sniffed media type of an acceptable upload; a Problem otherwise.

    The bytes decide: a valid PNG declared as JPEG is served as a PNG.
    """
    if not data:
        raise Problem(400, "empty-image", "Empty image", "the image is empty")
    declared = (declared_type or "").split(";")[0].strip().lower()
    if declared and declared != "application/octet-stream" and not declared.startswith("image/"):
        raise Problem(415, "unsupported-media-type", "Unsupported media type",
                      f"{declared!r} is not an image type; send one of {', '.join(ACCEPTED_TYPES)}")
    sniffed = sniff_image_type(data)
    if sniffed is None:
        raise Problem(415, "unsupported-media-type", "Unsupported media type",
                      "the content is not a JPEG, PNG, WebP, BMP or GIF image")
    return sniffed


def parse_options(values: Mapping[str, str], max_deadline_ms: int) -> Options:
    """conf, iou in [0, 1]; max_det in [1, 1000]; deadline_ms in [1, default deadline]."""
    return Options(
        conf=_number(values, "conf", float, 0.0, 1.0),
        iou=_number(values, "iou", float, 0.0, 1.0),
        max_det=_number(values, "max_det", int, 1, 1000),
        deadline_ms=_number(values, "deadline_ms", int, 1, max_deadline_ms),
    )


def _number(values: Mapping[str, str], name: str, kind: type, low: float, high: float) -> Any:
    raw = values.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise _bad_param(name, f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}")
    if isinstance(value, float) and not math.isfinite(value) or not low <= value <= high:
        raise _bad_param(name, f"{name}={raw!r} must be between {low:g} and {high:g}")
    return value


def _bad_param(name: str, detail: str) -> Problem:
    return Problem(400, "invalid-parameter", "Invalid parameter", detail,
                   invalid_params=[{"name": name, "reason": detail}])
