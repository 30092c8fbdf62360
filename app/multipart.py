"""A multipart/form-data body already in memory, split with a few searches instead of Werkzeug's parser.

Werkzeug parses a form as a stream: 64 KiB at a time, each piece appended to a buffer, searched with a
regular expression and cut from its front, and a file part copied into its container piece by piece: a large
share of what the whole submission costs the API (docs/benchmarks/2026-12-03-cpu-per-image.md). The body is
already whole here (`read_whole_body`), so `parse_form` finds the delimiters with `bytes.find` and takes
each part's content as one slice.

It reads only the plain form every client sends (RFC 7578: CRLF line breaks, `Content-Disposition:
form-data; name=...`, no header continuation lines) and gives up (None) on anything else, so that
Werkzeug's parser, with its tolerance and its error messages, still decides every unusual body. Where it
does read a body, it reads what Werkzeug reads: the same names, values (decoded by the part's charset as
Werkzeug does), files and media types (a test compares the two on every form the clients send).
"""

from __future__ import annotations

from dataclasses import dataclass

from werkzeug.datastructures import MultiDict
from werkzeug.http import parse_options_header

MAX_PART_HEADER_BYTES = 8192
MAX_PARTS = 64  # more than any submission needs (one image and its options); more: TooManyParts
_CHARSETS = {"ascii", "us-ascii", "utf-8", "iso-8859-1"}  # Werkzeug's list for a text part


class TooManyParts(ValueError):
    """The form has more than MAX_PARTS parts."""


@dataclass(frozen=True)
class FilePart:
    name: str
    filename: str
    mimetype: str  # the part's Content-Type without parameters, lower case ("" when absent)
    data: bytes


@dataclass(frozen=True)
class Form:
    fields: MultiDict[str, str]
    files: list[FilePart]

    def files_named(self, name: str) -> list[FilePart]:
        return [part for part in self.files if part.name == name]


def parse_form(body: bytes | bytearray, content_type: str) -> Form | None:
    """The form in `body`, or None when it is not the plain form this reads (Werkzeug's parser then decides);
    TooManyParts past MAX_PARTS parts."""
    mimetype, options = parse_options_header(content_type)
    boundary = options.get("boundary", "")
    if mimetype != "multipart/form-data" or not boundary or len(boundary) > 200 or not boundary.isascii():
        return None
    delimiter = b"--" + boundary.encode()
    if body.startswith(delimiter):
        pos = len(delimiter)
    else:
        start = body.find(b"\r\n" + delimiter)
        if start < 0:
            return None
        pos = start + 2 + len(delimiter)
    fields: list[tuple[str, str]] = []
    files: list[FilePart] = []
    next_delimiter = b"\r\n" + delimiter
    while not body.startswith(b"--", pos):  # the close delimiter ends the form
        if not body.startswith(b"\r\n", pos):
            return None
        if len(fields) + len(files) >= MAX_PARTS:
            raise TooManyParts(f"more than {MAX_PARTS} parts")
        headers_end = body.find(b"\r\n\r\n", pos)
        if headers_end < 0 or headers_end - pos > MAX_PART_HEADER_BYTES:
            return None
        headers = _part_headers(body[pos + 2 : headers_end])
        content_end = body.find(next_delimiter, headers_end + 4)
        if headers is None or content_end < 0:
            return None
        disposition, params = parse_options_header(headers.get("content-disposition", ""))
        name = params.get("name")
        if disposition != "form-data" or name is None:
            return None
        content = bytes(body[headers_end + 4 : content_end])
        part_type = headers.get("content-type", "")
        if "filename" in params:
            files.append(FilePart(name, params["filename"], parse_options_header(part_type)[0].lower(), content))
        else:
            charset = parse_options_header(part_type)[1].get("charset", "").lower()
            fields.append((name, content.decode(charset if charset in _CHARSETS else "utf-8", "replace")))
        pos = content_end + len(next_delimiter)
    return Form(MultiDict(fields), files)


def _part_headers(block: bytes | bytearray) -> dict[str, str] | None:
    """A part's header lines as {lower-case name: value}; None for what only Werkzeug should judge
    (bytes that are not UTF-8, continuation lines, a line without a colon, a header given twice)."""
    try:
        text = bytes(block).decode("utf-8")
    except UnicodeDecodeError:
        return None
    headers: dict[str, str] = {}
    for line in text.split("\r\n") if text else ():
        name, colon, value = line.partition(":")
        key = name.lower()
        if not colon or not name or name != name.strip() or line[:1] in (" ", "\t") or key in headers:
            return None
        headers[key] = value.strip()
    return headers
