"""Hostile image files, built in memory: the attacks of issue 40's decoder findings, for the tests and
`bench hostile`. Each is a valid-looking file of an accepted type whose framing or metadata costs the decoder
far more than its pixels do. No Pillow here beyond encoding the small images they wrap."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

# Every file wraps a small, ordinary picture: refused, it was refused for its structure, not its pixels.
_SIZE = (64, 48)


def _picture(fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", _SIZE, (200, 60, 30)).save(buffer, fmt, **params)
    return buffer.getvalue()


def gif_comment_bomb(comments: int = 400_000) -> bytes:
    """A GIF whose first frame follows `comments` one-byte comment extensions (5 bytes each): Pillow joins
    them by repeated byte concatenation, so the cost grows with their square (7.9 s for 400,000)."""
    plain = _picture("GIF")
    flags = plain[10]
    head = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # header, screen and its colour table
    return plain[:head] + b"\x21\xfe\x01x\x00" * comments + plain[head:]


def jpeg_with_app1(payload: bytes) -> bytes:
    """A JPEG whose first segment is an APP1 holding `payload` (no JFIF segment: Pillow then reads the EXIF
    for the image's dpi while opening it)."""
    plain = _picture("JPEG", quality=80)
    rest = _segments_after_jfif(plain)
    return b"\xff\xd8" + b"\xff\xe1" + struct.pack(">H", 2 + len(payload)) + payload + rest


def overlapping_exif(size: int, tags: int | None = None) -> bytes:
    """An EXIF block ("Exif\\0\\0" and a little-endian TIFF structure) of `size` bytes whose first directory's
    entries (as many as fit, or `tags`) all point at offset 0 with the whole block as their length: each is a
    copy of the whole block to Pillow, so the memory asked for is tags x size. (All but its last byte: a read of
    a whole buffer from its start is the buffer itself to CPython's BytesIO, not a copy.)"""
    tiff_size = size - 6
    fit = (tiff_size - 8 - 2 - 4) // 12
    count = fit if tags is None else min(tags, fit)
    entries = b"".join(struct.pack("<HHLL", 0x1000 + index, 7, tiff_size - 1, 0) for index in range(count))
    tiff = b"II*\x00" + struct.pack("<L", 8) + struct.pack("<H", count) + entries + b"\x00\x00\x00\x00"
    return b"Exif\x00\x00" + tiff + b"\x00" * (tiff_size - len(tiff))


def jpeg_exif_bomb() -> bytes:
    """A 66 KB JPEG whose EXIF segment (64 KB, the most one segment holds) has ~5,400 entries, each
    pointing at the whole segment: it grew a CPU worker child by 186 MB."""
    return jpeg_with_app1(overlapping_exif(65_533))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">L", len(data)) + kind + data + struct.pack(">L", zlib.crc32(kind + data))


def _png_parts() -> tuple[bytes, bytes]:
    """An ordinary PNG cut after its IHDR chunk: (signature + IHDR, the rest)."""
    plain = _picture("PNG")
    cut = 8 + 8 + 13 + 4
    return plain[:cut], plain[cut:]


def png_exif_bomb(size: int = 8 * 1024 * 1024, tags: int = 250) -> bytes:
    """A PNG whose eXIf chunk of `size` bytes has `tags` entries each pointing at all of it: reading its EXIF
    took a CPU worker child from 134 MB to 2.0 GB."""
    head, rest = _png_parts()
    return head + png_chunk(b"eXIf", overlapping_exif(size + 6, tags)[6:]) + rest


def png_chunk_flood(total_bytes: int = 19 * 1024 * 1024) -> bytes:
    """A PNG of empty ancillary chunks (12 bytes each; ~1.6 million in 19 MB) before its image data: Pillow
    reads each in Python (14.8 s)."""
    head, rest = _png_parts()
    empty = png_chunk(b"ruSt", b"")
    return head + empty * (total_bytes // len(empty)) + rest


def jpeg_comment_flood(total_bytes: int = 20 * 1024 * 1024 - 4096) -> bytes:
    """A JPEG of empty COM segments (4 bytes each) before its frame header: Pillow reads each in Python
    (11.4 s for 20 MB). By default just under the API's 20 MiB limit."""
    plain = _picture("JPEG", quality=80)
    return plain[:2] + b"\xff\xfe\x00\x02" * (total_bytes // 4) + plain[2:]


def gif_im_polyglot(width: int = 200, height: int = 100) -> bytes:
    """A body that starts like a GIF and is an IM file: Pillow's GIF plugin fails on it, and `Image.open`
    without `formats=` falls through to the IM plugin, which decodes it (a 200x100 image)."""
    header = b"GIF89a: not really\r\nImage type: RGB image\r\n" + f"Image size (x*y): {width}*{height}\r\n".encode()
    header += b"\x00" * (511 - len(header)) + b"\x1a"  # IM: the header is 512 bytes
    # Pixel bytes free of '!', ',' and ';', so the GIF plugin finds no block and gives up.
    return header + bytes([0x40]) * (width * height * 3)


def _segments_after_jfif(jpeg: bytes) -> bytes:
    """A JPEG's bytes after its SOI and (when first) its JFIF APP0 segment."""
    pos = 2
    if jpeg[pos : pos + 2] == b"\xff\xe0":
        pos += 2 + struct.unpack(">H", jpeg[pos + 2 : pos + 4])[0]
    return jpeg[pos:]


# --- the same attacks by other blocks: each costs Pillow a Python step, or more, per few bytes -------------
def gif_stray_bytes(total_bytes: int = 20 * 1024 * 1024) -> bytes:
    """A GIF whose first frame follows a run of bytes that start no block: Pillow steps through them one at a
    time (2.0 s for 20 MB)."""
    plain = _picture("GIF")
    flags = plain[10]
    head = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    return plain[:head] + b"\x00" * total_bytes + plain[head:]


def gif_long_comment(sub_blocks: int = 400_000) -> bytes:
    """One GIF comment extension of one-byte sub-blocks: joined one onto another (2.2 s for 400,000)."""
    plain = _picture("GIF")
    flags = plain[10]
    head = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    return plain[:head] + b"\x21\xfe" + b"\x01x" * sub_blocks + b"\x00" + plain[head:]


def jpeg_photoshop_flood(total_bytes: int = 20 * 1024 * 1024) -> bytes:
    """A JPEG of APP13 Photoshop segments full of empty 12-byte image resources: Pillow reads each resource in
    Python (1.2 s for 20 MB)."""
    resources = b"8BIM\x04\x04\x00\x00\x00\x00\x00\x00" * ((65_533 - 14) // 12)
    payload = b"Photoshop 3.0\x00" + resources
    segment = b"\xff\xed" + struct.pack(">H", 2 + len(payload)) + payload
    plain = _picture("JPEG", quality=80)
    return plain[:2] + segment * (total_bytes // len(segment)) + plain[2:]


def png_profile_flood(total_bytes: int = 19 * 1024 * 1024) -> bytes:
    """A PNG of iCCP chunks, each ~1 KB inflating to 1 MB: Pillow inflates every one (46 s for 19 MB)."""
    head, rest = _png_parts()
    chunk = png_chunk(b"iCCP", b"icc\x00\x00" + zlib.compress(b"\x00" * (1024 * 1024 - 1), 9))
    return head + chunk * (total_bytes // len(chunk)) + rest


def mpo_scan_bomb(width: int = 2048, height: int = 2048, repeats: int = 3000) -> bytes:
    """A progressive-JPEG scan bomb (tests.support.scan_bomb's) behind an MPF segment naming two images:
    Pillow opens it as an MPO, which the scan count (`decode.max_scans`) checked only for format "JPEG"
    (11.3 s for this 64 KB file)."""
    bomb = scan_bomb(width, height, repeats)
    entries = struct.pack(">LLLHH", 0x20030000, len(bomb), 0, 0, 0) + struct.pack(">LLLHH", 0, 10, 100, 0, 0)
    values = 8 + 2 + 12 * 3 + 4  # where the MP entries follow the directory
    directory = (
        struct.pack(">H", 3)
        + struct.pack(">HHL4s", 0xB000, 7, 4, b"0100")
        + struct.pack(">HHLL", 0xB001, 4, 1, 2)
        + struct.pack(">HHLL", 0xB002, 7, len(entries), values)
    )
    payload = b"MPF\x00" + b"MM\x00\x2a" + struct.pack(">L", 8) + directory + b"\x00" * 4 + entries
    return bomb[:2] + b"\xff\xe2" + struct.pack(">H", 2 + len(payload)) + payload + bomb[2:]


def scan_bomb(width: int, height: int, repeats: int) -> bytes:
    """A flat grey progressive JPEG whose last (AC) scan repeats `repeats` times: a few bytes a scan, a whole
    pass over the image each for the decoder."""
    flat = io.BytesIO()
    Image.new("L", (width, height), 128).save(flat, "JPEG", progressive=True, quality=90)
    segments = jpeg_segments(flat.getvalue())
    scans = [segment for marker, segment in segments if marker == 0xDA]
    head = b"".join(segment for marker, segment in segments if marker not in (0xDA, 0xD9))
    return b"\xff\xd8" + head + b"".join(scans) + scans[-1] * repeats + b"\xff\xd9"


def jpeg_segments(data: bytes) -> list[tuple[int, bytes]]:
    """(marker, whole segment bytes) of a JPEG, a scan's entropy-coded data kept with its SOS segment."""
    segments, pos = [], 2
    while pos < len(data):
        marker = data[pos + 1]
        if marker == 0xD9:
            segments.append((marker, data[pos : pos + 2]))
            break
        end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xDA:  # the scan's data runs to the next marker that is not a stuffed 0xFF or a restart
            while True:
                end = data.index(b"\xff", end)
                if data[end + 1] == 0 or 0xD0 <= data[end + 1] <= 0xD7:
                    end += 2
                    continue
                break
        segments.append((marker, data[pos:end]))
        pos = end
    return segments


# --- round five (issue 52): files that pass the header's limits and cost the decoder far more than they say ----
def webp_lossless_canvas(width: int = 8192, height: int = 8192) -> bytes:
    """A lossless WebP of one flat colour: 2.6 KB for 8192x8192. Pillow opens every WebP through libwebp's
    animation decoder, which holds two RGBA canvases, and copies the pixels twice more: 1,028 MB a child."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 140, 200)).save(buffer, "WEBP", lossless=True, quality=0, method=0)
    return buffer.getvalue()


def _riff_chunk(kind: bytes, data: bytes) -> bytes:
    return kind + struct.pack("<L", len(data)) + data + (b"\x00" if len(data) & 1 else b"")


def webp_animated_canvas(width: int = 8192, height: int = 8192) -> bytes:
    """An animated WebP of ~140 bytes: a `width` x `height` canvas (VP8X) and one frame of 1x1 pixel. libwebp's
    animation decoder allocates its canvases at the canvas's size whatever the frames are: 1,066 MB a child."""
    frame = io.BytesIO()
    Image.new("RGBA", (1, 1), (200, 60, 30, 255)).save(frame, "WEBP", lossless=True)
    bitstream = frame.getvalue()[12:]  # the frame's own VP8L chunk, as it stands in its file
    vp8x = struct.pack("<B3x", 0x12) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    anim = struct.pack("<LH", 0, 0)  # background, loop count
    anmf = bytes(15) + b"\x00" + bitstream  # at 0, 0; 1x1 (width and height less one); no duration; no flags
    body = b"WEBP" + _riff_chunk(b"VP8X", vp8x) + _riff_chunk(b"ANIM", anim) + _riff_chunk(b"ANMF", anmf)
    return b"RIFF" + struct.pack("<L", len(body)) + body


def bmp_rle(width: int, height: int, commands: bytes, bits: int = 8) -> bytes:
    """A BMP (BITMAPINFOHEADER) of `width` x `height` whose pixel data is `commands`, RLE8 (bits 8) or RLE4
    (bits 4) with a grey palette."""
    colours = 1 << bits
    palette = b"".join(bytes((i * 255 // (colours - 1),) * 3) + b"\x00" for i in range(colours))
    offset = 14 + 40 + len(palette)
    info = struct.pack(
        "<LllHHLLllLL", 40, width, height, 1, bits, 1 if bits == 8 else 2, len(commands), 2835, 2835, colours, 0
    )
    head = b"BM" + struct.pack("<LHHL", offset + len(commands), 0, 0, offset)
    return head + info + palette + commands


def bmp_rle_wide_row(width: int = 80_000_000) -> bytes:
    """The issue's 1 KB RLE8 BMP of 80,000,000 x 1: one pixel, then end of line (Pillow pads the row one Python
    step a pixel: 8.7 CPU-s, +382 MB)."""
    return bmp_rle(width, 1, b"\x01\x07\x00\x00\x00\x01")


def bmp_rle4_runs(width: int = 8_000, height: int = 10_000) -> bytes:
    """An RLE4 BMP whose rows are runs of 255 pixels: Pillow's RLE4 decoder takes a Python step per pixel."""
    row = b"\xff\x12" * (width // 255) + bytes((width % 255, 0x34)) + b"\x00\x00"
    return bmp_rle(width, height, row * height + b"\x00\x01", bits=4)


def gif_big_screen(width: int = 8944, height: int = 8944) -> bytes:
    """A 35-byte GIF: an 8944x8944 logical screen and one 1x1 frame. Pillow holds the frame on a screen-sized
    palette image, and the decode converted it to RGB at full size: +307 MB, 424 MB a child."""
    screen = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    return screen + frame + b"\x3b"


def png_palette(width: int = 8944, height: int = 8944) -> bytes:
    """A palette PNG of one colour, ~80 KB for 8944x8944: converted to RGB at full size, +383 MB."""
    image = Image.new("P", (width, height), 1)
    image.putpalette([0, 0, 0, 200, 60, 30] + [0] * (3 * 254))
    buffer = io.BytesIO()
    image.save(buffer, "PNG", optimize=False, compress_level=9)
    return buffer.getvalue()


def png_rgba(width: int = 8192, height: int = 8192) -> bytes:
    """An honest RGBA PNG of 8192x8192 (261 KB): within the 256 MiB cap by its pixels, +514 MB to decode."""
    buffer = io.BytesIO()
    Image.new("RGBA", (width, height), (30, 90, 160, 128)).save(buffer, "PNG", compress_level=9)
    return buffer.getvalue()


def jpeg_progressive_cmyk(width: int = 8192, height: int = 8192) -> bytes:
    """A progressive CMYK JPEG of 8192x8192 (~1 MB): libjpeg keeps every coefficient of a progressive image
    (2 bytes each, 4 components) whatever scale draft mode asks: 581 MB a child."""
    buffer = io.BytesIO()
    Image.new("CMYK", (width, height), (10, 80, 160, 20)).save(buffer, "JPEG", progressive=True, quality=50)
    return buffer.getvalue()


def png_itxt(key: bytes, text: bytes, compressed: bool = True) -> bytes:
    """One iTXt chunk: `text` (UTF-8) under `key`, deflated or not."""
    value = zlib.compress(text, 9) if compressed else text
    return png_chunk(b"iTXt", key + b"\0" + bytes((1 if compressed else 0, 0)) + b"\0\0" + value)


def png_text_bomb(image: bytes | None = None, chunks: int = 64, chars: int = 1024 * 1024) -> bytes:
    """A PNG (by default 1x1 RGBA; give another as `image`) with `chunks` deflated iTXt chunks before its image
    data, each `chars` - 3 ASCII characters and one outside the BMP: 1 MiB of UTF-8 that Pillow's caps allow (1 MiB
    inflated a chunk, 64 Mi characters in all), in ~1 KB. CPython stores such a string at 4 bytes a character:
    64 of them are +263 MB, read at open, before the decode's memory check (issue 59)."""
    if image is None:
        buffer = io.BytesIO()
        Image.new("RGBA", (1, 1), (30, 90, 160, 128)).save(buffer, "PNG")
        image = buffer.getvalue()
    cut = 8 + 8 + 13 + 4  # the signature and IHDR
    text = b"a" * (chars - 4) + "\U0001f600".encode()
    return image[:cut] + b"".join(png_itxt(b"k%d" % i, text) for i in range(chunks)) + image[cut:]


def png_rgba_text_bomb() -> bytes:
    """The honest 8192x8192 RGBA PNG (its 256 MiB, the cap) with png_text_bomb's 64 chunks: +535 MB."""
    return png_text_bomb(png_rgba())


def png_rgba16_adam7(width: int = 8192, height: int = 8192) -> bytes:
    """A 16-bit RGBA PNG of 8192x8192, Adam7-interlaced, every row Paeth-filtered (~0.5 MB, written here: Pillow
    writes none of that): within the 256 MiB cap as Pillow holds it (8 bits a sample), ~2 CPU-s to decode here
    against an honest RGBA one's ~0.5 (issue 59's probe: 2.5-3.1 against 0.94)."""
    packer = zlib.compressobj(9)
    chunks = []
    for x0, y0, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2)):
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        row = b"\x04" + bytes(columns * 8)  # Paeth (the dearest to undo), then 8 bytes a pixel
        chunks += [packer.compress(row) for _ in range(rows)]
    row = b"\x04" + bytes(width * 8)  # the seventh pass: every odd row, whole
    chunks += [packer.compress(row) for _ in range(height // 2)]
    chunks.append(packer.flush())
    header = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 1)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", b"".join(chunks))
        + png_chunk(b"IEND", b"")
    )
