"""app.multipart reads a form in memory as Werkzeug's parser does, or hands it back (None) for Werkzeug."""

from __future__ import annotations

import io
import os

import pytest
import requests
from werkzeug.test import EnvironBuilder

from app import InMemoryFormRequest
from app.multipart import MAX_PARTS, TooManyParts, parse_form

PHOTO = os.urandom(300_000) + b"\r\n--not-the-boundary\r\n" + os.urandom(1000)


def werkzeug_reads(body: bytes, content_type: str) -> tuple[list, list]:
    environ = EnvironBuilder(method="POST", data=body, content_type=content_type).get_environ()
    request = InMemoryFormRequest(environ)
    files = [(name, f.filename, f.mimetype, f.read()) for name, f in request.files.items(multi=True)]
    return list(request.form.items(multi=True)), files


def ours(body: bytes, content_type: str) -> tuple[list, list]:
    form = parse_form(body, content_type)
    assert form is not None
    return list(form.fields.items(multi=True)), [(f.name, f.filename, f.mimetype, f.data) for f in form.files]


def requests_form(files: dict, data: dict | None = None) -> tuple[bytes, str]:
    prepared = requests.Request("POST", "http://x/", files=files, data=data).prepare()
    return prepared.body, prepared.headers["Content-Type"]


def builder_form(data: dict) -> tuple[bytes, str]:
    environ = EnvironBuilder(method="POST", data=data).get_environ()
    return environ["wsgi.input"].read(), environ["CONTENT_TYPE"]


FORMS = {
    "requests, file only": requests_form({"image": ("a.jpg", PHOTO, "image/jpeg")}),
    "requests, file and options": requests_form(
        {"image": ("a.jpg", PHOTO, "image/JPEG")}, {"conf": "0.4", "model": "shapes-yolo:2.0.0"}
    ),
    "requests, no part type": requests_form({"image": ("a.jpg", PHOTO)}),
    "werkzeug's builder": builder_form({"image": (io.BytesIO(PHOTO), "photo.png", "image/png"), "iou": "0.5"}),
    "two images": requests_form([("image", ("a.jpg", PHOTO, "image/jpeg")), ("image", ("b.jpg", b"x", "image/png"))]),
    "an empty file and an empty field": requests_form({"image": ("a.jpg", b"", "image/jpeg")}, {"conf": ""}),
    "a preamble, an epilogue and a charset": (
        b'preamble\r\n--b0\r\nContent-Disposition: form-data; name="note"\r\n'
        b"Content-Type: text/plain; charset=iso-8859-1\r\n\r\ncaf\xe9\r\n"
        b"--b0\r\nContent-Disposition: form-data; name=\"image\"; filename*=UTF-8''%C3%A9t%C3%A9.jpg\r\n"
        b"Content-Type: image/jpeg\r\n\r\n" + PHOTO + b"\r\n--b0--\r\nepilogue",
        "multipart/form-data; boundary=b0",
    ),
    "a field that is not UTF-8": (
        b'--b0\r\nContent-Disposition: form-data; name="conf"\r\n\r\n\xff0.4\r\n--b0--\r\n',
        'multipart/form-data; boundary="b0"',
    ),
}


@pytest.mark.parametrize("name", FORMS)
def test_a_plain_form_reads_as_werkzeug_reads_it(name):
    body, content_type = FORMS[name]
    assert ours(body, content_type) == werkzeug_reads(body, content_type)


@pytest.mark.parametrize(
    "body",
    [
        b'--b0\nContent-Disposition: form-data; name="image"; filename="a"\n\nxx\n--b0--\n',  # LF only
        b'--b0\r\nContent-Disposition: form-data;\r\n name="image"; filename="a"\r\n\r\nxx\r\n--b0--\r\n',  # folded
        b'--b0\r\nContent-Disposition: form-data; name="image"; filename="\xff.jpg"\r\n\r\nxx\r\n--b0--\r\n',
        b'--b0  \r\nContent-Disposition: form-data; name="image"; filename="a"\r\n\r\nxx\r\n--b0--\r\n',  # padding
        b'--b0\r\nContent-Disposition: form-data; name="image"; filename="a"\r\n\r\nxx with no end',
        b'--b0\r\nContent-Disposition: attachment; name="image"\r\n\r\nxx\r\n--b0--\r\n',
        b"--b0\r\nContent-Disposition: form-data\r\n\r\nxx\r\n--b0--\r\n",  # no name
        b"--b0\r\nContent-Disposition: form-data; name=a\r\nContent-Disposition: form-data; name=b\r\n\r\nx\r\n--b0--",
        b"no delimiter at all",
    ],
)
def test_anything_else_is_left_to_werkzeug(body):
    assert parse_form(body, "multipart/form-data; boundary=b0") is None


def test_a_plain_form_of_more_parts_than_a_submission_has_is_refused_as_such():
    """Left to Werkzeug, 2,000 parts came back as 413 "exceeds the limit of 20971520 bytes" for 120 KB."""
    many = (
        b"".join(b'--b0\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(MAX_PARTS + 1))
        + b"--b0--\r\n"
    )
    with pytest.raises(TooManyParts):
        parse_form(many, "multipart/form-data; boundary=b0")
    enough = (
        b"".join(b'--b0\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(MAX_PARTS))
        + b"--b0--\r\n"
    )
    form = parse_form(enough, "multipart/form-data; boundary=b0")
    assert form is not None and len(form.fields) == MAX_PARTS


def test_not_a_form_or_no_boundary_is_left_to_werkzeug():
    body, content_type = FORMS["requests, file only"]
    assert parse_form(body, "multipart/form-data") is None
    assert parse_form(body, "multipart/mixed; boundary=x") is None
