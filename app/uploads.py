"""Validating a submission: the image bytes and the per-job options. Pure functions."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, TypeVar

from pydantic import BaseModel, ValidationError

from app.problems import Problem
from contract.documents import SubmitOptionsBase, submit_options_model

# Magic numbers of the image types we accept, checked on the bytes themselves.
_SIGNATURES = (
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"BM", "image/bmp"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
M = TypeVar("M", bound=BaseModel)
ACCEPTED_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp", "image/gif")


# Large reads: gunicorn buffers what one recv() brings and copies the rest of its buffer on every
# read, so 64 KiB reads of a 0.8 MB photo copied it a dozen times over.
_READ_CHUNK = 1024 * 1024


def declared_length(environ: dict[str, Any], limit: int) -> int | None:
    """The body's Content-Length when there is one; a Problem when it is not a number (400) or over
    `limit` (413): refused before anything is read or reserved."""
    declared = environ.get("CONTENT_LENGTH") or None
    if declared is None:
        return None
    try:
        expected = int(declared)
    except ValueError as exc:
        raise Problem(400, "malformed-body", "Malformed body", "Content-Length is not a number") from exc
    if expected > limit:
        raise Problem(413, "request-entity-too-large", "Request Entity Too Large",
                      f"the upload of {expected} bytes exceeds the limit of {limit} bytes")
    return expected


def read_whole_body(environ: dict[str, Any], limit: int) -> bytes:
    """The request body, all of it or a Problem: never a truncated one.

    Read from the server's own input (so Content-Length and chunked bodies are
    read alike), at most limit + 1 bytes: more than `limit` is 413 whatever the
    framing said; fewer bytes than Content-Length promised (the client went
    away) and broken chunked framing are 400.
    """
    expected = declared_length(environ, limit)
    stream, parts, size = environ["wsgi.input"], [], 0
    budget = expected if expected is not None else limit + 1
    try:
        while size < budget:
            chunk = stream.read(min(_READ_CHUNK, budget - size))
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
    except Exception as exc:   # the server's reader: broken chunked framing, a reset connection
        raise Problem(400, "malformed-body", "Malformed body",
                      f"the request body could not be read: {type(exc).__name__}") from exc
    if size > limit:
        raise Problem(413, "request-entity-too-large", "Request Entity Too Large",
                      f"the upload exceeds the limit of {limit} bytes")
    if expected is not None and size < expected:
        raise Problem(400, "truncated-body", "Truncated body",
                      f"the body ended after {size} of the {expected} bytes its Content-Length promised")
    return b"".join(parts)


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


def parse_options(values: Mapping[str, str], max_deadline_ms: int) -> SubmitOptionsBase:
    """conf, iou in [0, 1]; max_det in [1, 1000]; deadline_ms in [1, max_deadline_ms]; callback_url.
    The bounds live in `contract.documents`, which the OpenAPI document is generated from."""
    return validate_params(submit_options_model(max_deadline_ms), values)


def validate_params(model: type[M], values: Mapping[str, Any]) -> M:
    """Request parameters read through their model; a 400 naming each field at fault otherwise."""
    given = {name: value for name, value in values.items() if value is not None}
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        params = [{"name": str(error["loc"][0]), "reason": error["msg"]} for error in exc.errors()]
        first = params[0]["name"]
        detail = f"{first}={given.get(first)!r}: {params[0]['reason']}"
        raise Problem(400, "invalid-parameter", "Invalid parameter", detail, invalid_params=params) from None


def option_values(*sources: Any, names: Iterable[str]) -> dict[str, str]:
    """The named options from several MultiDicts (query string, form); naming one twice is a 400,
    so no value is silently ignored."""
    values: dict[str, str] = {}
    for source in sources:
        for name in set(names) & set(source.keys()):
            given = source.getlist(name)
            if name in values or len(given) > 1:
                detail = f"{name} is given more than once"
                raise Problem(400, "invalid-parameter", "Invalid parameter", detail,
                              invalid_params=[{"name": name, "reason": detail}])
            values[name] = given[0]
    return values
