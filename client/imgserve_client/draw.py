"""Draw a finished job's detections on its image: `imgserve submit --draw OUT`, or

    from imgserve_client.draw import draw_detections
    draw_detections("street.jpg", doc, "street.boxes.jpg")

Needs Pillow (or Pillow-SIMD), which the client does not require otherwise: `pip install
'imgserve-client[draw]'`. Boxes are in the original image's pixels with its EXIF orientation applied (as the
API gives them), so the image is turned the same way before drawing.
"""

from __future__ import annotations

from io import BytesIO
from pathlib import Path
from typing import Any

# One colour per class id, in turn: distinct on photos and on flat backgrounds.
COLOURS = (
    (255, 56, 56),
    (50, 205, 50),
    (30, 144, 255),
    (255, 178, 29),
    (207, 62, 255),
    (0, 212, 187),
    (255, 112, 31),
    (255, 55, 199),
)


class DrawingUnavailable(RuntimeError):
    """Pillow is not installed."""


def draw_detections(image: str | Path | bytes, doc: dict[str, Any], out: str | Path) -> Path:
    """Write `image` with the boxes, labels and scores of the finished job `doc`; returns the path written.
    The format follows `out`'s suffix (.jpg, .png, ...)."""
    try:
        from PIL import Image, ImageDraw, ImageFont, ImageOps
    except ImportError as exc:  # the client's only dependency is requests
        raise DrawingUnavailable("drawing needs Pillow: pip install 'imgserve-client[draw]'") from exc
    source = Image.open(BytesIO(image) if isinstance(image, (bytes, bytearray)) else image)
    picture = ImageOps.exif_transpose(source).convert("RGB")
    draw = ImageDraw.Draw(picture)
    side = max(picture.size)
    width = max(2, side // 400)
    try:
        font: Any = ImageFont.load_default(size=max(12, side // 60))
    except (TypeError, OSError):  # an older Pillow, or one without FreeType: the small bitmap font
        font = ImageFont.load_default()
    for detection in (doc.get("result") or {}).get("detections", []):
        colour = COLOURS[int(detection.get("class_id", 0)) % len(COLOURS)]
        x1, y1, x2, y2 = detection["box"]
        draw.rectangle((x1, y1, x2, y2), outline=colour, width=width)
        caption = f"{detection.get('label', detection.get('class_id'))} {detection['score']:.2f}"
        left, top, right, bottom = draw.textbbox((0, 0), caption, font=font)
        text_w, text_h = right - left, bottom - top
        y = y1 - text_h - 2 * width if y1 - text_h - 2 * width >= 0 else y1  # above the box, or inside it
        draw.rectangle((x1, y, x1 + text_w + 2 * width, y + text_h + 2 * width), fill=colour)
        draw.text((x1 + width - left, y + width - top), caption, fill=(0, 0, 0), font=font)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path)
    return path
