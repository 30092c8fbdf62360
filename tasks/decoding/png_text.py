"""What a PNG's text chunks (tEXt, zTXt, iTXt) will cost Pillow in memory, judged from their bytes before it reads
them. Pure functions; zlib only, no Pillow.

Pillow keeps every text chunk's value in the image's `info` as a Python string, read at open when the chunk comes
before the image data (and at the end of the load when it follows it). Its caps count characters: 1 MiB inflated
a chunk, 64 Mi characters in all. CPython stores a string at 1, 2 or 4 bytes a character, by its widest one, so
one character outside the BMP in a chunk of ASCII makes it four: a small file of deflated iTXt chunks would
hold hundreds of MB before the decode's memory check ran. The service reads only an orientation from
text (ImageMagick's `Raw profile type exif`, XMP); nothing else in it is worth memory.

`held_bytes` says what one chunk's value will hold: its characters at the width CPython stores them, and the bytes
Pillow keeps beside the string (a tEXt `exif` value, an iTXt XMP packet). A deflated value is inflated here to
know (at C speed, at most TEXT_CHUNK_BYTES, Pillow's own cap a chunk): tasks.decoding.structure stops the walk, and so
the inflating, once the file's total is past its limit.
"""

from __future__ import annotations

import re
import zlib

TEXT_KINDS = frozenset({b"tEXt", b"zTXt", b"iTXt"})
# At most this many bytes inflated a zTXt or iTXt chunk: Pillow's PngImagePlugin.MAX_TEXT_CHUNK (its default,
# 1 MiB), set to this by tasks.decoding.imaging so the two agree. Past it Pillow refuses the file.
TEXT_CHUNK_BYTES = 1024 * 1024
# UTF-8 lead bytes of characters past U+00FF (stored at 2 bytes a character) and past U+FFFF (4 bytes).
_PAST_LATIN_1 = re.compile(rb"[\xc4-\xef]")
_PAST_BMP = re.compile(rb"[\xf0-\xff]")


def held_bytes(kind: bytes, chunk: bytes) -> int:
    """The bytes Pillow will hold for the text chunk `chunk` (its data, without length, type and CRC)."""
    key, _, rest = chunk.partition(b"\0")
    if kind == b"tEXt":  # Latin-1: a byte a character; the `exif` key's value is kept as bytes too
        return len(rest) * (2 if key == b"exif" else 1)
    if kind == b"zTXt":  # a method byte, then the deflated Latin-1 value
        return len(_inflated(rest[1:])) if rest[:1] == b"\0" else 0
    if len(rest) < 2:  # iTXt: compression flag and method, language, translated keyword, then the value
        return 0
    flag, method = rest[0], rest[1]
    parts = rest[2:].split(b"\0", 2)
    if len(parts) < 3 or (flag and method):  # Pillow skips a value it cannot read
        return 0
    value = _inflated(parts[2]) if flag else parts[2]
    width = 4 if _PAST_BMP.search(value) else 2 if _PAST_LATIN_1.search(value) else 1
    return len(value) * width + (len(value) if key == b"XML:com.adobe.xmp" else 0)


def _inflated(deflated: bytes) -> bytes:
    """The value as Pillow inflates it: at most TEXT_CHUNK_BYTES (past it Pillow refuses the file, and this counts
    the cap), nothing if it is not a zlib stream (Pillow drops it)."""
    try:
        return zlib.decompressobj().decompress(deflated, TEXT_CHUNK_BYTES)
    except zlib.error:
        return b""
