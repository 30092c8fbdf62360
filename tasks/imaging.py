"""Decode and letterbox one image: the CPU half of the pipeline. Pure functions.

No torch here: a CPU worker that imported it would pay seconds and hundreds of
MB per child for nothing.
"""
from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps

# EXIF orientations that swap width and height.
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION_TAG = 0x0112


class ImageDecodeError(ValueError):
    """An upload that is not a usable image; `code` names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Letterboxed:
    pixels: bytes       # height * width * 3, RGB, contiguous
    width: int
    height: int
    pad_left: int
    pad_top: int
    scale_x: float
    scale_y: float
    orig_width: int
    orig_height: int


def decode_image(data: bytes, target_size: int, max_pixels: int) -> tuple[Image.Image, tuple[int, int]]:
    """Decode to an upright RGB image, no larger than needed for `target_size`.

    Returns the image and the original upright (width, height): JPEG draft
    mode may decode at 1/2, 1/4 or 1/8 scale, so the image can be smaller.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            orig_size = _upright_size(image)
            if orig_size[0] * orig_size[1] > max_pixels:
                raise ImageDecodeError("image_too_large", f"image of {orig_size[0]}x{orig_size[1]} "
                                       f"pixels exceeds the limit of {max_pixels}")
            if image.format == "JPEG":
                _draft_for(image, target_size)
            image.seek(0)
            image.load()
            image = ImageOps.exif_transpose(image)
            return to_rgb(image), orig_size
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageDecodeError("image_too_large", str(exc)) from exc
    except Exception as exc:  # Pillow raises many types for corrupt data
        raise ImageDecodeError("decode_error", f"cannot decode image: {exc}") from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB; transparency is composited on the pad grey."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        return _sixteen_bit_to_rgb(image)
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA"):
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (114, 114, 114, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def letterbox(image: Image.Image, orig_size: tuple[int, int], size: int) -> Letterboxed:
    """Resize keeping the aspect ratio so the long side is `size`; centre it.

    Only the content is returned; the GPU worker pads it into the square input.
    """
    orig_w, orig_h = orig_size
    ratio = size / max(orig_w, orig_h)
    new_w = max(1, min(size, round(orig_w * ratio)))
    new_h = max(1, min(size, round(orig_h * ratio)))
    if image.size != (new_w, new_h):
        image = image.resize((new_w, new_h), Image.BILINEAR)
    return Letterboxed(
        pixels=image.tobytes(),
        width=new_w,
        height=new_h,
        pad_left=(size - new_w) // 2,
        pad_top=(size - new_h) // 2,
        scale_x=new_w / orig_w,
        scale_y=new_h / orig_h,
        orig_width=orig_w,
        orig_height=orig_h,
    )


def _upright_size(image: Image.Image) -> tuple[int, int]:
    width, height = image.size
    orientation = image.getexif().get(_EXIF_ORIENTATION_TAG, 1)
    return (height, width) if orientation in _TRANSPOSING_ORIENTATIONS else (width, height)


def _draft_for(image: Image.Image, target_size: int) -> None:
    """Ask libjpeg to decode at the smallest DCT scale still >= the target."""
    width, height = image.size
    ratio = target_size / max(width, height)
    if ratio < 1.0:
        image.draft("RGB", (math.ceil(width * ratio), math.ceil(height * ratio)))


def _sixteen_bit_to_rgb(image: Image.Image) -> Image.Image:
    import numpy as np

    values = np.asarray(image, dtype=np.uint32)
    top = int(values.max()) or 1
    shift = max(0, top.bit_length() - 8)
    gray = (values >> shift).clip(0, 255).astype(np.uint8)
    return Image.fromarray(gray, mode="L").convert("RGB")
