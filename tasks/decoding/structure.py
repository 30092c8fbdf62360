"""What an image's framing and metadata will cost Pillow, judged from its bytes before Pillow opens it.

Pillow reads a file's structure in Python: a JPEG's segments up to its first scan, a PNG's chunks, a GIF's
blocks up to its first frame, and an EXIF block's first directory, copying each entry's value. A file made
of nothing but structure (4-byte comment segments, 12-byte chunks, 5-byte comment extensions, directory
entries that all point at the whole block) cost seconds and gigabytes while its pixels cost nothing. Each
walk here steps through the file as Pillow will, counts the steps Pillow's Python will take, and stops once
past a limit, so it costs at most that many Python steps itself; runs of bytes that Pillow reads one at a
time are skipped at C speed (find, a regex) and counted by their length.

The walks follow Pillow 12's parsers (JpegImagePlugin's marker loop, PngImagePlugin's chunk stream,
GifImagePlugin._seek, TiffImagePlugin's directory loader), not the formats' specifications: where the two
disagree on a crafted file, the file must be judged as Pillow will read it. Pure functions; no Pillow here.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from tasks.decoding import png_text


class TooComplex(ValueError):
    """A file whose structure asks for more work or memory than allowed; the message says which limit."""


@dataclass(frozen=True)
class StructureLimits:
    """contract.settings.DecodeSettings' structural limits (the same defaults; see there)."""

    max_blocks: int = 20_000
    max_comment_blocks: int = 1_000
    max_exif_bytes: int = 256 * 1024
    max_exif_tags: int = 1_000
    max_rle_commands: int = 1_000_000


DEFAULT_LIMITS = StructureLimits()


@dataclass(frozen=True)
class Structure:
    """What a walk learnt on the way: whether the image has an EXIF block Pillow will hold in `info["exif"]`,
    the orientation its first directory names (None: it names none), and for a JPEG that libjpeg decodes
    scan by scan (progressive, or a first scan without every component) the bytes of the coefficients it
    keeps for the whole image meanwhile, at full size whatever scale draft mode asks for (0 for any other); for
    a PNG, the bytes its text chunks will hold in `info` (tasks.decoding.png_text)."""

    has_exif: bool = False
    orientation: int | None = None
    coefficient_bytes: int = 0
    text_bytes: int = 0


# Fixed rules, beside the settings: no real file comes near them.
MAX_EXIF_PREFIXES = 4  # "Exif\0\0" headers Pillow strips one by one, copying the rest each time
MAX_EXIF_SEGMENTS = 16  # JPEG APP1 EXIF segments Pillow joins one by one (the standard has one)
MAX_PNG_PROFILES = 4  # iCCP chunks, each inflated up to 1 MB (the PNG standard allows one)
MAX_PNG_TEXT_BYTES = (
    8 * 1024 * 1024
)  # what text chunks hold as Pillow keeps them (tasks.decoding.png_text); a photo's: KBs

ORIENTATION_TAG = 0x0112


class _Steps:
    """Counts Pillow's steps against a limit: past it, TooComplex at once."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what, self.used = limit, what, 0

    def take(self, count: int = 1) -> None:
        self.used += count
        if self.used > self.limit:
            raise TooComplex(f"{self.what}: more than {self.limit}; refused before decoding")


def check(data: bytes, fmt: str, limits: StructureLimits) -> Structure:
    """Walk the structure of `data`, a file of Pillow format `fmt`; TooComplex if it asks for too much."""
    walk = _WALKS.get(fmt)
    return walk(data, limits) if walk else Structure()


# --- JPEG: Pillow's marker loop, up to the first scan (libjpeg, in C, reads the rest) -------------------
_FILL = re.compile(rb"\xff+")
# Markers Pillow reads no length for (its table gives them no handler); any other from 0xC0 has one.
_NO_LENGTH = frozenset([0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)])
_SOF = frozenset([0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE])


def _jpeg(data: bytes, limits: StructureLimits) -> Structure:  # noqa: C901  # one walk, a branch per marker kind
    steps = _Steps(
        limits.max_blocks, "JPEG segments, and bytes between them, before the first scan (a photo has about 20)"
    )
    exif: list[tuple[int, int]] = []  # the APP1 EXIF payloads, as Pillow joins them
    exif_bytes = 0
    mpf: tuple[int, int] | None = None
    frame: tuple[int, bytes] | None = None  # the first SOF: its marker and its payload
    scan_components = 0
    pos, size = 2, len(data)
    while pos + 1 < size:
        if data[pos] != 0xFF:  # junk: Pillow reads it a byte at a time
            found = data.find(b"\xff", pos)
            if found < 0:
                break
            steps.take(found - pos)
            pos = found
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill bytes: a step each
            fill = _FILL.match(data, pos)
            end = fill.end() if fill else pos + 1
            steps.take(end - pos - 1)
            pos = end - 1
            continue
        steps.take()
        if marker == 0x00 or marker in _NO_LENGTH:
            pos += 2
            continue
        if marker < 0xC0 or pos + 4 > size:  # Pillow: "no marker found", or the file ends
            break
        start, end = pos + 4, pos + 2 + max(2, (data[pos + 2] << 8) | data[pos + 3])
        if marker == 0xDA or end > size:  # the first scan, or a segment the file cuts short
            scan_components = data[start] if marker == 0xDA and start < size else 0
            break
        if marker == 0xDB:  # DQT: a Python loop per 65-byte table
            steps.take((end - start) // 65)
        elif marker in _SOF:  # SOF: a Python step per 3 bytes (a component each)
            steps.take((end - start) // 3)
            frame = frame or (marker, data[start:end])
        elif marker == 0xED and data.startswith(b"Photoshop 3.0\x00", start, end):
            steps.take(data.count(b"8BIM", start, end))  # a Python step per image resource
        elif marker == 0xE1 and data.startswith(b"Exif\x00\x00", start, end):
            exif.append((start + 6 if exif else start, end))  # Pillow: info["exif"] += s[6:]
            exif_bytes += exif[-1][1] - exif[-1][0]
            if len(exif) > MAX_EXIF_SEGMENTS or exif_bytes > limits.max_exif_bytes:
                raise TooComplex(
                    f"JPEG EXIF of {len(exif)} segments and {exif_bytes} bytes: over "
                    f"{MAX_EXIF_SEGMENTS} segments or decode.max_exif_bytes "
                    f"({limits.max_exif_bytes}); refused before decoding"
                )
        elif marker == 0xE2 and data.startswith(b"MPF\x00", start, end):
            mpf = (start + 4, end)  # the last one counts: Pillow keeps it alone
        pos = end
    if mpf is not None:  # Pillow reads every value of the MPO index directory
        _directory(data, *mpf, limits, "MPF (MPO index)")
    coefficients = coefficient_bytes(*frame, scan_components) if frame else 0
    if not exif:
        return Structure(coefficient_bytes=coefficients)
    joined = b"".join(data[start:end] for start, end in exif)
    return Structure(has_exif=True, orientation=exif_orientation(joined, limits), coefficient_bytes=coefficients)


_PROGRESSIVE = frozenset([0xC2, 0xC6, 0xCA, 0xCE])


def coefficient_bytes(marker: int, frame: bytes, scan_components: int) -> int:
    """What libjpeg holds for a frame (an SOF's marker and payload) it decodes scan by scan: every DCT coefficient
    of the image, 2 bytes each, 64 a block, each component's blocks rounded up to whole MCUs (jdcoefct.c's
    whole-image buffer). A frame whose first scan carries every component, not progressive, is decoded as it
    streams: 0."""
    count = frame[5] if len(frame) > 5 else 0
    if marker not in _PROGRESSIVE and scan_components >= count:
        return 0
    height, width = (frame[1] << 8) | frame[2], (frame[3] << 8) | frame[4]
    factors = [(max(1, frame[7 + 3 * i] >> 4), max(1, frame[7 + 3 * i] & 0x0F)) for i in range((len(frame) - 6) // 3)]
    if not factors:
        return 0
    h_max, v_max = max(h for h, _ in factors), max(v for _, v in factors)
    total = 0
    for h, v in factors:
        across = _ceil(_ceil(width * h, h_max), 8)  # the component's blocks across, and down
        down = _ceil(_ceil(height * v, v_max), 8)
        total += _ceil(across, h) * h * _ceil(down, v) * v * 64 * 2
    return total


def _ceil(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


# --- PNG: every chunk, each a Python step (reading, CRC, its handler) -----------------------------------
def _png(data: bytes, limits: StructureLimits) -> Structure:
    steps = _Steps(limits.max_blocks, "PNG chunks (an image has a few, plus one per 8-64 KB of pixel data)")
    exif: tuple[int, int] | None = None
    profiles = text = 0
    pos, size = 8, len(data)
    while pos + 8 <= size:
        length, kind = struct.unpack_from(">L4s", data, pos)
        steps.take()
        start, end = pos + 8, pos + 8 + length
        if kind == b"IEND" or end + 4 > size:
            break
        if kind in png_text.TEXT_KINDS:
            text += length if length > MAX_PNG_TEXT_BYTES else png_text.held_bytes(kind, data[start:end])  # no copy
            if text > MAX_PNG_TEXT_BYTES:
                what = f"PNG text chunks holding more than {MAX_PNG_TEXT_BYTES} bytes (only an orientation is read)"
                raise TooComplex(f"{what}; refused before decoding")
        elif kind == b"eXIf":
            exif = (start, end)  # the last one counts: Pillow keeps it alone
        elif kind == b"iCCP":
            profiles += 1
            if profiles > MAX_PNG_PROFILES:
                raise TooComplex(
                    f"more than {MAX_PNG_PROFILES} PNG iCCP chunks (each inflated up to 1 MB; "
                    "the standard allows one); refused before decoding"
                )
        pos = end + 4
    if exif is None:
        return Structure(text_bytes=text)
    return Structure(has_exif=True, orientation=exif_orientation(data, limits, *exif), text_bytes=text)


# --- GIF: Pillow's _seek(0), up to the first frame's image descriptor -----------------------------------
_GIF_BLOCK = re.compile(rb"[!,;]")


def _gif(data: bytes, limits: StructureLimits) -> Structure:
    steps = _Steps(limits.max_blocks, "GIF blocks, sub-blocks and bytes between them before the first frame")
    comments = _Steps(
        limits.max_comment_blocks,
        "GIF comment blocks before the first frame (Pillow joins them one by one: the cost grows with their square)",
    )
    size = len(data)
    flags = data[10] if size > 10 else 0
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # past the screen and its colour table
    while pos < size:
        byte = data[pos]
        if byte in (0x2C, 0x3B):  # the first image descriptor, or the trailer
            break
        if byte != 0x21:  # anything else: Pillow reads it a byte at a time
            found = _GIF_BLOCK.search(data, pos)
            end = found.start() if found else size
            steps.take(end - pos)
            pos = end
            continue
        label = data[pos + 1] if pos + 1 < size else -1
        steps.take()
        block = pos + 2
        pos, got = _sub_block(data, block)
        if label == 0xFE:  # comment: joined sub-block by sub-block, then onto the last
            comments.take()
            while got:
                steps.take()
                comments.take()
                pos, got = _sub_block(data, pos)
            continue
        if label == 0xFF and got and data.startswith(b"NETSCAPE2.0", block + 1, pos):
            steps.take()
            pos, _ = _sub_block(data, pos)  # the loop count: one more self.data()
        while True:  # `while self.data(): pass`, past a terminator if need be
            steps.take()
            pos, got = _sub_block(data, pos)
            if not got:
                break
    return Structure()


def _sub_block(data: bytes, pos: int) -> tuple[int, bool]:
    """Where the sub-block at `pos` (a size byte, then that many bytes) ends, and whether Pillow's
    self.data() reading it returns something true (not None for a 0 size or the file's end, not b"")."""
    if pos >= len(data):
        return pos + 1, False
    return pos + 1 + data[pos], data[pos] > 0 and pos + 1 < len(data)


# --- WebP: its RIFF chunks (libwebp's demuxer, in C, keeps a record of each) ----------------------------
def _webp(data: bytes, limits: StructureLimits) -> Structure:
    steps = _Steps(limits.max_blocks, "WebP chunks")
    exif: tuple[int, int] | None = None
    pos, size = 12, len(data)
    while pos + 8 <= size:
        kind, length = struct.unpack_from("<4sL", data, pos)
        steps.take()
        start, end = pos + 8, pos + 8 + length
        if kind == b"EXIF" and exif is None and end <= size:
            exif = (start, end)  # the first one counts: libwebp hands Pillow that one
        pos = end + (length & 1)
    if exif is None:
        return Structure()
    return Structure(has_exif=True, orientation=exif_orientation(data, limits, *exif))


_WALKS = {"JPEG": _jpeg, "PNG": _png, "GIF": _gif, "WEBP": _webp}


# --- EXIF: the first directory (IFD0), as TiffImagePlugin loads it --------------------------------------
# Pillow's TIFF headers (BigTIFF aside: an EXIF block in that form fails to load before any entry is read).
_BYTE_ORDERS = {b"MM\x00\x2a": ">", b"II\x2a\x00": "<", b"MM\x2a\x00": ">", b"II\x00\x2a": "<"}
# Bytes per value of each type Pillow loads (an entry of another type is skipped).
_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8}
_INTEGER_TYPES = {1: "B", 3: "H", 4: "L", 6: "b", 8: "h", 9: "l"}


def exif_orientation(data: bytes, limits: StructureLimits, start: int = 0, end: int | None = None) -> int | None:
    """The orientation the EXIF block data[start:end] names in its first directory, read as Pillow's
    getexif() reads it: None when it names none, 0 when its value is not one number (Pillow turns the image
    for neither); TooComplex when reading it would take more than the limits allow."""
    end = len(data) if end is None else end
    first = start
    while data.startswith(b"Exif\x00\x00", start, end):  # Pillow strips them one by one
        start += 6
        if start - first > 6 * MAX_EXIF_PREFIXES:
            raise TooComplex(
                f"an EXIF block behind more than {MAX_EXIF_PREFIXES} 'Exif' headers; refused before decoding"
            )
    return _directory(data, start, end, limits, "EXIF")


def _directory(data: bytes, start: int, end: int, limits: StructureLimits, what: str) -> int | None:
    """Check the TIFF structure in data[start:end] as Pillow loads its first directory: its entries, and the
    bytes Pillow copies for the values stored out of line (each read afresh, however they overlap). Returns
    the orientation entry's value (see exif_orientation)."""
    order = _BYTE_ORDERS.get(data[start : start + 4]) if end - start >= 8 else None
    if order is None:
        return None
    length = end - start
    (offset,) = struct.unpack_from(order + "L", data, start + 4)
    if offset + 2 > length:
        return None
    (count,) = struct.unpack_from(order + "H", data, start + offset)
    readable = min(count, (length - offset - 2) // 12)  # Pillow stops where the block does
    if readable > limits.max_exif_tags:
        raise TooComplex(
            f"{what} directory of {readable} entries: over decode.max_exif_tags "
            f"({limits.max_exif_tags}); refused before decoding"
        )
    first = start + offset + 2
    copied, orientation = 0, None
    for tag, kind, number, value in struct.iter_unpack(order + "HHL4s", data[first : first + 12 * readable]):
        unit = _TYPE_SIZES.get(kind)
        if unit is None or number == 0:
            continue
        if number * unit > 4:  # out of line: Pillow copies it from the offset the entry names
            (at,) = struct.unpack(order + "L", value)
            copied += min(number * unit, max(0, length - at))
            if copied > limits.max_exif_bytes:
                raise TooComplex(
                    f"{what} directory whose values take more than decode.max_exif_bytes "
                    f"({limits.max_exif_bytes}) bytes to read (its {readable} entries overlap "
                    f"in a block of {length}); refused before decoding"
                )
            if tag == ORIENTATION_TAG:
                orientation = 0
        elif tag == ORIENTATION_TAG:
            code = _INTEGER_TYPES.get(kind)
            orientation = struct.unpack(order + code, value[:unit])[0] if code and number == 1 else 0
    return orientation
