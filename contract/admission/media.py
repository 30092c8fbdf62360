"""The image types the service accepts, told by their first bytes: the API's sniff (its 415) and the CPU
worker's choice of decoder read the same table, so a body is decoded as the type it was admitted as and
nothing else (Pillow, left to guess, tries every plugin it has)."""

from __future__ import annotations

# (magic number, media type, Pillow's format name); WebP is a RIFF container told by bytes 8-12.
_SIGNATURES = (
    (b"\xff\xd8\xff", "image/jpeg", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "image/png", "PNG"),
    (b"BM", "image/bmp", "BMP"),
    (b"GIF87a", "image/gif", "GIF"),
    (b"GIF89a", "image/gif", "GIF"),
)
ACCEPTED_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp", "image/gif")
ACCEPTED_TYPES_TEXT = "a JPEG, PNG, WebP, BMP or GIF image"


def sniff(data: bytes | bytearray | memoryview) -> tuple[str, str] | None:
    """(media type, Pillow format) of an acceptable image by its first bytes; None for anything else."""
    head = bytes(data[:12])
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp", "WEBP"
    for signature, media_type, pillow_format in _SIGNATURES:
        if head.startswith(signature):
            return media_type, pillow_format
    return None
