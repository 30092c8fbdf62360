"""Decode and letterbox one image: the CPU half of the pipeline. Pure functions.

No torch here: a CPU worker that imported it would pay seconds and hundreds of
MB per child for nothing.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image, ImageFile, PngImagePlugin

from contract.admission import media
from contract.frames import Placement
from tasks.decoding import bmp_rle, peak_memory, png_text
from tasks.decoding.structure import (
    DEFAULT_LIMITS,
    MAX_PNG_TEXT_BYTES,
    Structure,
    StructureLimits,
    TooComplex,
    exif_orientation,
)
from tasks.decoding.structure import check as check_structure

# EXIF orientations that swap width and height, and what turns each upright (as ImageOps.exif_transpose).
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# Pillow's getexif() takes the orientation from XMP when the EXIF names none.
_XMP_ORIENTATION = r'tiff:Orientation(="|>)([0-9])'


bmp_rle.install()  # BMP RLE decoded at C speed a pixel (Pillow's own decoder took a Python step for some)
# Pillow's caps on PNG text, as the walk counts it (tasks.decoding.png_text): its default allowed 64 Mi characters,
# up to 4 bytes each. The walk refuses first; these hold if it and Pillow ever read a file differently.
PngImagePlugin.MAX_TEXT_CHUNK = png_text.TEXT_CHUNK_BYTES
PngImagePlugin.MAX_TEXT_MEMORY = MAX_PNG_TEXT_BYTES


class ImageDecodeError(ValueError):
    """An upload that is not a usable image; `code` names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Letterboxed:
    pixels: bytes  # height * width * 3, RGB, contiguous
    placement: Placement


def decode_image(
    data: bytes | memoryview,
    target_size: int,
    max_pixels: int,
    max_decoded_bytes: int = 256 * 1024 * 1024,
    max_scans: int = 100,
    max_pixel_scans: int = 2_000_000_000,
    structure: StructureLimits = DEFAULT_LIMITS,
) -> tuple[Image.Image, tuple[int, int]]:
    """Decode to an upright RGB image, no larger than needed for `target_size`.

    Returns the image and the original upright (width, height): JPEG draft
    mode may decode at 1/2, 1/4 or 1/8 scale, so the image can be smaller.
    The bytes are opened as the type their first bytes say, by that plugin
    alone, and their structure is walked first (tasks.decoding.structure): framing and
    metadata that would cost more than `structure` allows are refused before
    Pillow reads them. Memory stays near one decoded copy: the header's
    promise is checked against `max_pixels`, and what the decode will hold at
    its peak (tasks.decoding.peak_memory: by format and mode, a WebP's decoder and a
    progressive JPEG's coefficients counted) against `max_decoded_bytes`, before
    anything is decoded; a format without draft mode is reduced by an integer
    factor right after decoding (palette and alpha images a tile at a time),
    and the other conversions (16-bit) run on the reduced image.
    """
    raw = data if isinstance(data, bytes) else bytes(data)  # the one copy: BytesIO shares a bytes object
    try:
        sniffed = media.sniff(raw)
        if sniffed is None:
            raise ImageDecodeError("decode_error", f"cannot decode image: not {media.ACCEPTED_TYPES_TEXT}")
        fmt = sniffed[1]
        found = check_structure(raw, fmt, structure)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = _open(raw, fmt, max_pixels)
            width, height = image.size
            if width * height > max_pixels:
                raise ImageDecodeError("image_too_large", too_many_pixels(f"{width}x{height}", max_pixels))
            if image.format in ("JPEG", "MPO"):  # an MPO (a JPEG with an MPF index) is a JPEG to libjpeg
                if image.info.get("progressive"):
                    # Only a progressive JPEG decodes scan after scan: libjpeg refuses a baseline one whose scan
                    # repeats at once ("broken data stream"), so the count's cost is spared photos.
                    _check_scans(raw, width, height, max_scans, max_pixel_scans)
                _draft_for(image, target_size)
                if isinstance(image, ImageFile.ImageFile) and arithmetic_coded(raw):
                    # libjpeg's arithmetic decoder cannot suspend for more data: fed 64 KB at a time (Pillow's
                    # block), any such JPEG past one block failed "broken data stream". It gets the whole stream.
                    image.decodermaxblock = max(image.decodermaxblock, len(raw))
            # The decode's peak as this format and mode take it (tasks.decoding.peak_memory), after a JPEG's draft.
            peak = peak_memory.peak_bytes(image, fmt, found)
            if peak > max_decoded_bytes:
                raise ImageDecodeError(
                    "image_too_large",
                    f"image of {width}x{height}: decoding it takes {peak} bytes "
                    f"({peak_memory.describe(image, fmt, found)}), over the limit of {max_decoded_bytes}",
                )
            if fmt == "WEBP":
                info = image.info
                image = peak_memory.load_webp(image)
            else:
                image.seek(0)
                with _rle_limit(structure.max_rle_commands):
                    image.load()
                info = image.info
            # Only now: a PNG's text chunks may follow its pixels.
            orientation = _orientation(found, info, structure)
            orig_size = (height, width) if orientation in _TRANSPOSING_ORIENTATIONS else (width, height)
            image = _reduced(image, target_size)
            if orientation in _UPRIGHT:
                image = image.transpose(_UPRIGHT[orientation])
            return to_rgb(image), orig_size
    except ImageDecodeError:
        raise
    except TooComplex as exc:
        raise ImageDecodeError("image_too_complex", str(exc)) from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's check on a later frame (a GIF's), at the same limit: said in the service's words.
        counted = re.search(r"\((\d+) pixels\)", str(exc))
        size = counted[1] if counted else "more"
        raise ImageDecodeError("image_too_large", too_many_pixels(size, max_pixels)) from exc
    except Exception as exc:  # Pillow raises many types for corrupt data
        raise ImageDecodeError("decode_error", f"cannot decode image: {_without_addresses(str(exc))}") from exc


# The start-of-frame markers of arithmetic coding (SOF9-11, SOF13-15); the others are Huffman's.
_ARITHMETIC_FRAMES = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def arithmetic_coded(data: bytes) -> bool:
    """Whether a JPEG's frame is arithmetic-coded: its markers read up to the first scan (a walk the structure
    check has made already, so the lengths hold)."""
    at = 2
    while at + 4 <= len(data) and data[at] == 0xFF:
        marker = data[at + 1]
        if marker in _ARITHMETIC_FRAMES:
            return True
        if marker == 0xDA:  # the first scan: the frame was not arithmetic
            return False
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return False


def too_many_pixels(size: str, max_pixels: int) -> str:
    """The one message for an image over decode.max_image_pixels, whoever found it."""
    return f"image of {size} pixels exceeds the limit of {max_pixels} (decode.max_image_pixels)"


def _open(raw: bytes, fmt: str, max_pixels: int) -> Image.Image:
    """The image opened by its own type's plugin (formats=: a body that fails it is not handed to the next
    one that accepts it), its header read. One pixel limit, the service's: Pillow's own (89,478,485 by
    default, checked inside open) refused a 120 MP image that decode.max_image_pixels allowed, in Pillow's
    words. Its check is off for the open, where the caller's says it with the size, and follows the setting
    afterwards, for what Pillow checks later (a GIF's frames)."""
    Image.MAX_IMAGE_PIXELS = None
    try:
        return Image.open(io.BytesIO(raw), formats=[fmt])
    finally:
        Image.MAX_IMAGE_PIXELS = max_pixels


@contextmanager
def _rle_limit(commands: int) -> Iterator[None]:
    token = bmp_rle.MAX_COMMANDS.set(commands)
    try:
        yield
    finally:
        bmp_rle.MAX_COMMANDS.reset(token)


def _orientation(found: Structure, info: dict, limits: StructureLimits) -> int | None:
    """The EXIF orientation as Pillow's getexif() finds it, never by it: Pillow copies every value of the
    directory (tasks.decoding.structure bounds that for the EXIF it reads itself, a JPEG's; this reads none)."""
    if found.orientation is not None:
        return found.orientation
    if not found.has_exif and "Raw profile type exif" in info:  # ImageMagick's PNG text chunk
        try:
            exif = bytes.fromhex("".join(info["Raw profile type exif"].split("\n")[3:]))
        except ValueError:
            exif = b""
        orientation = exif_orientation(exif, limits)
        if orientation is not None:
            return orientation
    xmp = info.get("XML:com.adobe.xmp") or info.get("xmp")
    if xmp:
        match = re.search(_XMP_ORIENTATION if isinstance(xmp, str) else _XMP_ORIENTATION.encode(), xmp)
        if match:
            return int(match[2])
    return None


SOS = b"\xff\xda"


def _check_scans(data: bytes, width: int, height: int, max_scans: int, max_pixel_scans: int) -> None:
    """Refuse a JPEG whose scans ask for more decoding than allowed, before a scan is decoded. Every scan
    starts with an SOS marker, and entropy-coded data never holds one (a 0xFF there is followed by 0x00 or a
    restart marker), so counting the marker's bytes gives an upper bound at C speed (other segments may hold
    the same two bytes); only a file over a limit by that bound is walked segment by segment."""
    bound = data.count(SOS)
    if bound <= max_scans and width * height * bound <= max_pixel_scans:
        return
    scans = jpeg_scans(data, max_scans)
    if scans > max_scans:
        raise ImageDecodeError(
            "image_too_complex",
            f"a JPEG of more than {max_scans} scans (a progressive image has about ten); refused before decoding",
        )
    if width * height * scans > max_pixel_scans:
        raise ImageDecodeError(
            "image_too_complex",
            f"{scans} scans of {width}x{height} pixels: more decoding work "
            f"than the limit of {max_pixel_scans} pixel-scans",
        )


def jpeg_scans(data: bytes, stop_after: int) -> int:
    """The scans (SOS segments) of a JPEG, by its segment structure, counted up to stop_after + 1; a structure
    that breaks off ends the count (the decoder reports what is wrong with it)."""
    scans, pos, size = 0, 2, len(data)
    while pos + 4 <= size and scans <= stop_after:
        if data[pos] != 0xFF:
            break
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        if marker == 0xD9:  # end of image
            break
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker != 0xDA:
            continue
        scans += 1
        while True:  # past the scan's entropy-coded data
            pos = data.find(b"\xff", pos)
            if pos < 0 or pos + 1 >= size:
                return scans
            following = data[pos + 1]
            if following == 0x00 or 0xD0 <= following <= 0xD7:
                pos += 2
            elif following == 0xFF:
                pos += 1
            else:
                break
    return scans


def _without_addresses(message: str) -> str:
    """Pillow's messages can name an object by its memory address: not for clients to see."""
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the upload", message)


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
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    return Letterboxed(
        image.tobytes(),
        Placement(
            width=new_w,
            height=new_h,
            pad_left=(size - new_w) // 2,
            pad_top=(size - new_h) // 2,
            scale_x=new_w / orig_w,
            scale_y=new_h / orig_h,
            orig_width=orig_w,
            orig_height=orig_h,
        ),
    )


def _reduced(image: Image.Image, target_size: int) -> Image.Image:
    """The image shrunk by the largest integer factor that keeps its long side >= target_size
    (box filter: cheap, and the letterbox's resize does the rest)."""
    factor = max(image.size) // max(1, target_size)
    if factor < 2:
        return image
    if image.mode in peak_memory.TILED_MODES:  # converted and reduced a tile at a time: no full-size copy
        return peak_memory.reduce_in_tiles(image, factor)
    try:
        return image.reduce(factor)
    except (ValueError, NotImplementedError):  # a mode reduce() does not handle (16-bit): a box resize does
        return image.resize((max(1, image.width // factor), max(1, image.height // factor)), Image.Resampling.BOX)


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
