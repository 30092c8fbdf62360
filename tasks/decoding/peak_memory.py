"""What a decode really holds at its peak, judged before a pixel is decoded, and the steps that keep it there.

`decode.max_decoded_bytes` bounds the decode's peak, not the image's nominal size: decodes hold two to four
times what a pixel's storage (4 bytes at most) says. By format:

- WebP: Pillow 12 opens every WebP through libwebp's animation decoder, which keeps two RGBA canvases of the
  whole canvas (whatever the frames' sizes), and copied the frame out twice more: 16 bytes a canvas pixel
  (a tiny lossless file of a huge canvas: docs/benchmarks/2026-12-06-hostile-round-five.md). `load_webp` takes the frame
  once and lets the decoder go: WEBP_BYTES_PER_PIXEL at the peak (the two canvases and the copy; a lossless frame's own
  buffer is freed before the copy is made).
- JPEG: the image at the scale draft mode chose, plus, for a progressive (or multi-scan) file, every
  coefficient of the whole image at full size (tasks.decoding.structure.coefficient_bytes): draft mode does not
  shrink those.
- Palette, and images with alpha: converted and reduced a tile at a time (`reduce_in_tiles`), never at full
  size: converted whole, a tiny GIF of a huge screen holds hundreds of MB (the same log), an RGBA PNG twice its
  pixels (Pillow's reduce premultiplies a copy of the whole image).
- BMP RLE: the decoder's own buffer (tasks.decoding.bmp_rle) beside the image's.
- PNG text: every text chunk's value, held in `info` from the open on (tasks.decoding.png_text), beside the pixels.

Pure functions of Pillow images; nothing here reads a file's bytes but through Pillow and libwebp.
"""

from __future__ import annotations

from PIL import Image

from tasks.decoding.structure import Structure

# Bytes per pixel as Pillow holds an image in memory (3-channel images take 4).
STORAGE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2, "LA": 4, "PA": 4}
# libwebp's two RGBA canvases and the frame copied out of them, a canvas pixel (load_webp).
WEBP_BYTES_PER_PIXEL = 12
# A tile of reduce_in_tiles, converted: about this many bytes, whatever the image's shape.
TILE_BYTES = 8 * 1024 * 1024
# Modes reduce_in_tiles converts or reduces a tile at a time (Pillow's reduce copies an alpha image whole).
TILED_MODES = frozenset({"P", "PA", "LA", "RGBA"})


def storage_bytes(mode: str) -> int:
    return STORAGE_BYTES.get(mode, 4)


def peak_bytes(image: Image.Image, fmt: str, found: Structure) -> int:
    """The memory decoding `image` (opened, not loaded; a JPEG after its draft) will hold at its peak."""
    width, height = image.size
    if fmt == "WEBP":
        return width * height * WEBP_BYTES_PER_PIXEL
    pixels = width * height * storage_bytes(image.mode)
    if fmt == "JPEG":
        return pixels + found.coefficient_bytes
    tile = getattr(image, "tile", None)  # an ImageFile's, opened and not loaded
    if fmt == "BMP" and tile and tile[0].codec_name == "bmp_rle":
        return pixels + width * height  # tasks.decoding.bmp_rle's buffer, a byte a pixel, until the image holds it
    return pixels + found.text_bytes  # a PNG's text chunks, held in `info` beside the pixels (tasks.decoding.png_text)


def describe(image: Image.Image, fmt: str, found: Structure) -> str:
    """What peak_bytes counted, for the refusal's message."""
    width, height = image.size
    if fmt == "WEBP":
        return f"libwebp's decoder holds {WEBP_BYTES_PER_PIXEL} bytes a pixel of its {width}x{height} canvas"
    what = f"{width}x{height} {image.mode}"
    if fmt == "JPEG" and found.coefficient_bytes:
        return f"{what}, and {found.coefficient_bytes} bytes of coefficients: a progressive or multi-scan JPEG"
    if found.text_bytes:
        return f"{what}, and {found.text_bytes} bytes of PNG text chunks"
    return what


def load_webp(image: Image.Image) -> Image.Image:
    """The first frame of a WebP opened by Pillow, decoded once: Pillow's own load keeps libwebp's decoder (two
    canvases) while it copies the frame into a new image. Here the frame's bytes become the image's memory
    (frombuffer) and the decoder goes as soon as they are out. The decoder is the one Pillow opened the file
    with (its `_decoder`, at the first frame): a second one would allocate two more canvases, and under the CPU
    worker's malloc settings (contract.runtime.memory) canvases under 32 MiB come from the heap, zeroed: resident."""
    mode, size = image.mode, image.size
    decoder = image._decoder  # type: ignore[attr-defined]  # WebPImageFile's libwebp animation decoder
    rawmode = image.rawmode  # type: ignore[attr-defined]  # RGBA, or RGBX without alpha
    image._decoder = None  # type: ignore[attr-defined]
    image.close()
    got = decoder.get_next()
    del decoder
    if got is None:
        raise ValueError("failed to decode the first frame of the WebP file")
    return Image.frombuffer(mode, size, got[0], "raw", rawmode, 0, 1)


def reduce_in_tiles(image: Image.Image, factor: int) -> Image.Image:
    """image.reduce(factor) of a palette or alpha image (TILED_MODES), the same pixels, without its full-size
    copies: a tile at a time, each a whole number of factor x factor blocks (but at the right and bottom
    edges, as reduce's own last blocks), converted (palette: to RGB, or RGBA with transparency) and reduced."""
    mode = image.mode
    target = {"P": "RGBA" if "transparency" in image.info else "RGB", "PA": "RGBA"}.get(mode, mode)
    width, height = image.size
    out = Image.new(target, (-(-width // factor), -(-height // factor)))
    blocks = max(1, TILE_BYTES // (4 * factor * factor))  # factor x factor blocks a tile
    across = max(1, min(-(-width // factor), blocks))
    down = max(1, blocks // across)
    step_x, step_y = across * factor, down * factor
    for top in range(0, height, step_y):
        for left in range(0, width, step_x):
            tile = image.crop((left, top, min(width, left + step_x), min(height, top + step_y)))
            if tile.mode != target:
                tile = tile.convert(target)
            out.paste(tile.reduce(factor), (left // factor, top // factor))
    return out
