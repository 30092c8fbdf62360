"""Issue 40's decoder findings, as attacks on the CPU worker's decode: each hostile file is built here
(bench.hostile_files), decoded, and must be refused with its reason."""
from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from bench import hostile_files as hostile
from tasks.imaging import ImageDecodeError, decode_image


def test_the_gif_im_polyglot_is_opened_as_a_gif_only():
    """A body that starts GIF89a and is an IM file: Pillow's GIF plugin fails on it, and Image.open without
    formats= fell through to the IM plugin: the job succeeded as a 200x100 image."""
    polyglot = hostile.gif_im_polyglot()
    assert Image.open(io.BytesIO(polyglot)).format == "IM"                 # the bypass, as it was
    started = time.process_time()
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(polyglot, 320, 80_000_000)
    assert caught.value.code == "decode_error" and "cannot identify image file" in str(caught.value)
    assert time.process_time() - started < 2.0
