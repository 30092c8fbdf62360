"""A submission's request: its body read whole within its limits (app.uploads), then the image from the raw body or
from the form's `image` part, and the form's other fields (app.multipart's parser where it can, else Werkzeug's);
the options a submission may give, its callback_url checked, and the `wait` of a submission or a job read."""

from __future__ import annotations

import io
import logging
from collections.abc import Collection

from flask import Request, g
from flask import request as current_request
from werkzeug.datastructures import MultiDict
from werkzeug.exceptions import RequestEntityTooLarge

from app.holds import BodyHold
from app.multipart import MAX_PARTS, TooManyParts, parse_form
from app.problems import Problem
from app.services import services as current_services
from app.uploads import option_values, read_whole_body, refuse_unknown_fields, validate_params
from contract.callbacks import CallbackRefused, callback_secret, check_callback_url
from contract.documents import (
    Document,
    SubmitOptionsBase,
    submit_options_model,
    submit_query_model,
    wait_query_model,
)
from contract.jobs.deadlines import longest_deadline_ms
from contract.settings import ApiSettings, Settings
from contract.settings.models import model_references
from contract.settings.sections import SettingsError

log = logging.getLogger("api")  # app.jobs' logger: a refused callback_url logs as before


def read_submission(
    request: Request, api: ApiSettings, fields: Collection[str], hold: BodyHold | None = None
) -> tuple[bytes, str | None, MultiDict[str, str]]:
    """The upload from a multipart field `image` or from the raw body, and the form's other fields, after
    the whole body was read and checked (read_whole_body): the form is parsed from those bytes, by
    app.multipart where it can (one slice per part), else by Werkzeug. A part named neither `image` nor
    one of `fields` is a 400: a misspelt option would otherwise be dropped without a word. `hold`: the request's
    share of the body budget (app.holds), which a chunked body's bytes and a form's copy of its image take too."""
    chunked = request.environ.get("CONTENT_LENGTH") in (None, "")  # its Content-Length was taken before
    reserve = hold.take if hold is not None and chunked else None
    body = read_whole_body(request.environ, api.max_upload_bytes, api.body_timeout_s, api.body_min_rate, reserve)
    request.environ.update({"wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))})
    request.environ.pop("HTTP_TRANSFER_ENCODING", None)
    request.environ["wsgi.input_terminated"] = False
    if request.mimetype != "multipart/form-data":
        return body, request.mimetype, MultiDict()
    try:
        form = parse_form(body, request.content_type or "")
        if form is not None:
            uploads = [(part.data, part.mimetype) for part in form.files_named("image")]
            given, part_names = form.fields, [*form.fields.keys(), *(part.name for part in form.files)]
        else:  # Werkzeug's parser, held to the same count (create_app sets MAX_FORM_PARTS)
            uploads = [(part.read(), part.mimetype) for part in request.files.getlist("image")]
            given, part_names = request.form, [*request.form.keys(), *request.files.keys()]
    except (TooManyParts, RequestEntityTooLarge) as exc:
        # Werkzeug says 413 for too many parts, and the body was within the size limit: a form of this shape is
        # no submission, whatever its size (one image and a few options).
        raise Problem(
            400,
            "too-many-parts",
            "Too many parts",
            f"the multipart body has more than {MAX_PARTS} parts; a submission is one 'image' part and its options",
        ) from exc
    if form is None and not uploads:
        _refuse_unparsable_multipart(request, body)
    refuse_unknown_fields(part_names, known={"image", *fields})
    if hold is not None and uploads:
        hold.take(sum(len(data) for data, _ in uploads))  # each part is a copy of its slice of the body
    if not uploads:
        raise Problem(
            400, "missing-image", "Missing image", "multipart/form-data submissions need a file field named 'image'"
        )
    if len(uploads) > 1:
        raise Problem(
            400,
            "invalid-parameter",
            "Invalid parameter",
            f"send one file field named 'image', not {len(uploads)}",
            invalid_params=[{"name": "image", "reason": "given more than once"}],
        )
    return uploads[0][0], uploads[0][1], given


def _refuse_unparsable_multipart(request: Request, body: bytes) -> None:
    """Werkzeug drops a multipart body it cannot parse without a word; say why instead of "missing"."""
    from werkzeug.formparser import parse_form_data

    environ = {**request.environ, "wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))}
    try:
        parse_form_data(environ, silent=False)
    except Exception as exc:
        reason = "a part's headers are not UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)[:200]
        raise Problem(
            400,
            "malformed-body",
            "Malformed body",
            f"the multipart body cannot be parsed: {reason}",
            invalid_params=[{"name": "image", "reason": reason}],
        ) from exc


def submit_options(settings: Settings) -> type[SubmitOptionsBase]:
    """deadline_ms is bounded here by the longest default deadline of any model (app.jobs then applies its own
    model's: contract.jobs.deadlines' policy); `model` takes the names and name:version a request may reach."""
    return submit_options_model(_longest_deadline_ms(settings), tuple(model_references(settings)))


def submit_query(settings: Settings) -> type[Document]:
    """The options, and `wait` (the query only: it is about this request, not the job)."""
    return submit_query_model(
        _longest_deadline_ms(settings), tuple(model_references(settings)), settings.api.max_wait_s
    )


def _longest_deadline_ms(settings: Settings) -> int:
    return longest_deadline_ms(settings.default_deadline_ms(spec) for spec in settings.models)


def checked_callback_url(url: str | None, settings: Settings) -> str | None:
    if not url:
        return None
    try:
        secret = callback_secret(settings, g.get("client_id"))
    except SettingsError:
        secret = None
    if not secret:
        raise Problem(
            400,
            "callbacks-disabled",
            "Callbacks disabled",
            "no callback secret is configured for this deployment (callbacks.secret) or, with API "
            "keys, for your key (auth.api_keys[].callback_secret_env or callback_secret_file)",
        )
    # Looked up in a thread of the process's own, within callbacks.lookup_timeout_s, a bounded number per key
    # (app.callback_lookups): glibc's resolver on the event loop's thread would stall every request.
    key = g.get("client_id") or f"address:{request_address()}"
    try:
        check_callback_url(url, settings.callbacks.allow_hosts, current_services().callback_lookups.resolver(key))
    except CallbackRefused as exc:
        # What the lookup found stays here: "'vm' resolves to 127.0.0.1" told clients what internal names are.
        log.info("callback_url refused: %s", exc, extra={"client_id": g.get("client_id")})
        raise Problem(
            400,
            "invalid-parameter",
            "Invalid parameter",
            f"callback_url: {exc.public}",
            invalid_params=[{"name": "callback_url", "reason": exc.public}],
        ) from exc
    return url


def request_address() -> str:
    return current_request.remote_addr or "-"


def wait_seconds(max_wait_s: float) -> float:
    given = option_values(current_request.args, names=("wait",))
    return validate_params(wait_query_model(max_wait_s), given).wait or 0.0
