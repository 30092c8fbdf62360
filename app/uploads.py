"""Validating a submission: the image bytes and the per-job options. Pure functions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from app.problems import Problem
from contract.admission import media
from contract.admission.media import ACCEPTED_TYPES, ACCEPTED_TYPES_TEXT
from contract.documents import SubmitOptionsBase, submit_options_model

M = TypeVar("M", bound=BaseModel)


# Large reads: gunicorn buffers what one recv() brings and copies the rest of its buffer on every
# read, so small reads copy a photo many times over.
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
        raise Problem(
            413,
            "request-entity-too-large",
            "Request Entity Too Large",
            f"the upload of {expected} bytes exceeds the limit of {limit} bytes",
        )
    return expected


def read_whole_body(
    environ: dict[str, Any],
    limit: int,
    timeout_s: float = 10.0,
    min_rate: float = 65536.0,
    reserve: Callable[[int], None] | None = None,
) -> bytes:
    """The request body, all of it or a Problem: never a truncated one, and never a slow one.

    Read from the server's own input (so Content-Length and chunked bodies are
    read alike), at most limit + 1 bytes: more than `limit` is 413 whatever the
    framing said; fewer bytes than Content-Length promised (the client went
    away) and broken chunked framing are 400. Under gunicorn, the body must come
    within `timeout_s` plus its size at `min_rate` bytes/s, and no read may wait
    longer than `timeout_s`: else 408 (a client sending 1 byte a second held a
    worker's greenlet and its connection for as long as it cared to). `reserve`,
    when given, is told of each read's bytes before it is made (a body budget:
    app.holds); what it raises is the answer.
    """
    expected = declared_length(environ, limit)
    stream = environ["wsgi.input"]
    budget = expected if expected is not None else limit + 1
    sock = environ.get("gunicorn.socket")
    deadline = time.monotonic() + timeout_s + budget / max(1.0, min_rate)
    prior = sock.gettimeout() if sock is not None else None
    whole = _whole_read_bound(deadline - time.monotonic()) if sock is not None else contextlib.nullcontext()
    try:
        with whole:  # gunicorn's reader loops over recv() until it has what was asked: bound all of it too
            parts, size = _read_parts(stream, budget, sock, deadline, timeout_s, reserve)
    except Problem:
        raise
    except TimeoutError as exc:
        raise Problem(
            408, "request-timeout", "Request Timeout", "the body came too slowly: not all of it in the time allowed"
        ) from exc
    except Exception as exc:  # the server's reader: broken chunked framing, a reset connection
        raise Problem(
            400, "malformed-body", "Malformed body", f"the request body could not be read: {type(exc).__name__}"
        ) from exc
    finally:
        if sock is not None:
            sock.settimeout(prior)
    if size > limit:
        raise Problem(
            413,
            "request-entity-too-large",
            "Request Entity Too Large",
            f"the upload exceeds the limit of {limit} bytes",
        )
    if expected is not None and size < expected:
        raise Problem(
            400,
            "truncated-body",
            "Truncated body",
            f"the body ended after {size} of the {expected} bytes its Content-Length promised",
        )
    return b"".join(parts)


def _whole_read_bound(seconds: float) -> Any:
    """In a gevent worker, a timeout that interrupts whatever read is blocking when the body's deadline passes;
    elsewhere nothing (each recv() is bounded by the socket's timeout alone)."""
    try:
        from gevent import Timeout
        from gevent.monkey import is_module_patched
    except ImportError:
        return contextlib.nullcontext()
    if not is_module_patched("socket"):
        return contextlib.nullcontext()
    return Timeout(max(0.001, seconds), TimeoutError("the body's deadline passed"))


def _read_parts(
    stream: Any, budget: int, sock: Any, deadline: float, timeout_s: float, reserve: Callable[[int], None] | None
) -> tuple[list[bytes], int]:
    parts: list[bytes] = []
    size = 0
    while size < budget:
        if sock is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the body's deadline passed")
            sock.settimeout(min(remaining, timeout_s))
        want = min(_READ_CHUNK, budget - size)
        if reserve is not None:
            reserve(want)
        chunk = stream.read(want)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return parts, size


def sniff_image_type(data: bytes) -> str | None:
    sniffed = media.sniff(data)
    return sniffed[0] if sniffed else None


def check_image(data: bytes, declared_type: str | None) -> str:
    """The sniffed media type of an acceptable upload; a Problem otherwise.

    The bytes decide: a valid PNG declared as JPEG is served as a PNG.
    """
    if not data:
        raise Problem(400, "empty-image", "Empty image", "the image is empty")
    declared = (declared_type or "").split(";")[0].strip().lower()
    if declared and declared != "application/octet-stream" and not declared.startswith("image/"):
        raise Problem(
            415,
            "unsupported-media-type",
            "Unsupported media type",
            f"{declared!r} is not an image type; send one of {', '.join(ACCEPTED_TYPES)}",
        )
    sniffed = sniff_image_type(data)
    if sniffed is None:
        raise Problem(
            415, "unsupported-media-type", "Unsupported media type", f"the content is not {ACCEPTED_TYPES_TEXT}"
        )
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


def refuse_unknown_fields(given: Iterable[str], known: Collection[str], where: str = "form field") -> None:
    """A 400 naming every form field (or, with where="query parameter", query parameter) that is not one this
    operation takes."""
    unknown = sorted({name for name in given if name not in known})
    if unknown:
        reason = "not a field of this form" if where == "form field" else f"not a {where} of this operation"
        reasons = [{"name": name, "reason": reason} for name in unknown]
        raise Problem(
            400,
            "invalid-parameter",
            "Invalid parameter",
            f"unknown {where}(s): "
            + ", ".join(repr(name) for name in unknown)
            + "; known: "
            + ", ".join(sorted(known)),
            invalid_params=reasons,
        )


def option_values(*sources: Any, names: Iterable[str]) -> dict[str, str]:
    """The named options from several MultiDicts (query string, form); naming one twice is a 400,
    so no value is silently ignored."""
    values: dict[str, str] = {}
    for source in sources:
        for name in set(names) & set(source.keys()):
            given = source.getlist(name)
            if name in values or len(given) > 1:
                detail = f"{name} is given more than once"
                raise Problem(
                    400,
                    "invalid-parameter",
                    "Invalid parameter",
                    detail,
                    invalid_params=[{"name": name, "reason": detail}],
                )
            values[name] = given[0]
    return values
