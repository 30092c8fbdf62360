"""Submission validation: pure functions, including a property test."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.problems import Problem
from app.uploads import check_image, parse_options, sniff_image_type
from tests.support import encode, make_image


@pytest.mark.parametrize(
    "fmt,media_type",
    [("JPEG", "image/jpeg"), ("PNG", "image/png"), ("WEBP", "image/webp"), ("BMP", "image/bmp"), ("GIF", "image/gif")],
)
def test_real_images_are_sniffed_by_their_bytes(fmt, media_type):
    data = encode(make_image(16, 16), fmt)
    assert sniff_image_type(data) == media_type
    assert check_image(data, "image/jpeg") == media_type  # the bytes win over the declared type


@pytest.mark.parametrize(
    "data,declared,status",
    [
        (b"", "image/jpeg", 400),
        (b"plain text", "text/plain", 415),
        (b"\xff\xd8\xff\xe0", "text/html", 415),
        (b"random bytes here", "image/png", 415),
    ],
)
def test_unacceptable_uploads_are_problems(data, declared, status):
    with pytest.raises(Problem) as caught:
        check_image(data, declared)
    assert caught.value.status == status


def test_options_parse_and_fall_back_to_model_defaults():
    options = parse_options({"conf": "0.4", "max_det": "7", "deadline_ms": "500"}, 60_000)
    assert options.for_model() == {"conf": 0.4, "max_det": 7}
    assert options.deadline_ms == 500


@pytest.mark.parametrize(
    "values",
    [
        {"conf": "abc"},
        {"conf": "1.5"},
        {"iou": "nan"},
        {"max_det": "0"},
        {"max_det": "2.5"},
        {"deadline_ms": "-1"},
        {"deadline_ms": "999999"},
    ],
)
def test_bad_options_are_400_naming_the_field(values):
    with pytest.raises(Problem) as caught:
        parse_options(values, 60_000)
    assert caught.value.status == 400
    assert caught.value.extra["invalid_params"][0]["name"] == next(iter(values))


@given(st.binary(max_size=64), st.sampled_from(["image/jpeg", "image/png", "text/plain", "", None]))
def test_no_bytes_make_validation_raise_anything_but_a_problem(data, declared):
    try:
        check_image(data, declared)
    except Problem as problem:
        assert problem.status in (400, 415)


@given(st.dictionaries(st.sampled_from(["conf", "iou", "max_det", "deadline_ms"]), st.text(max_size=12)))
def test_no_option_text_makes_parsing_raise_anything_but_a_problem(values):
    try:
        parse_options(values, 60_000)
    except Problem as problem:
        assert problem.status == 400


def test_an_option_named_twice_is_a_400_not_a_silent_choice():
    from werkzeug.datastructures import MultiDict

    from app.uploads import option_values

    names = ("conf", "max_det")
    assert option_values(MultiDict({"conf": "0.3"}), MultiDict({"max_det": "5", "other": "x"}), names=names) == {
        "conf": "0.3",
        "max_det": "5",
    }
    for sources in (
        (MultiDict({"conf": "0.3"}), MultiDict({"conf": "0.5"})),  # query and form
        (MultiDict([("max_det", "1"), ("max_det", "2")]),),
    ):  # repeated in one
        with pytest.raises(Problem) as caught:
            option_values(*sources, names=names)
        assert caught.value.status == 400 and "more than once" in caught.value.detail
