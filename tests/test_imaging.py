"""Decode and letterbox: the CPU worker's pure functions."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tasks.decoding.imaging import ImageDecodeError, decode_image, letterbox
from tests.support import encode, jpeg, make_image

LIMIT = 80_000_000


@pytest.mark.parametrize(
    "size,expected",
    [
        ((1920, 1080), dict(width=640, height=360, pad_left=0, pad_top=140)),
        ((1080, 1920), dict(width=360, height=640, pad_left=140, pad_top=0)),
        ((100, 50), dict(width=640, height=320, pad_left=0, pad_top=160)),
        ((1, 10000), dict(width=1, height=640, pad_left=319, pad_top=0)),
    ],
)
def test_letterbox_keeps_the_aspect_ratio_and_centres_the_content(size, expected):
    image = make_image(*size)
    boxed = letterbox(image, size, 640)
    for name, value in expected.items():
        assert getattr(boxed.placement, name) == value, name
    assert len(boxed.pixels) == boxed.placement.width * boxed.placement.height * 3
    assert boxed.placement.scale_x == pytest.approx(boxed.placement.width / size[0])
    assert boxed.placement.scale_y == pytest.approx(boxed.placement.height / size[1])


def test_large_jpeg_is_decoded_in_draft_mode_but_reports_its_full_size():
    data = encode(make_image(4000, 3000), "JPEG", quality=90)
    image, orig = decode_image(data, 640, LIMIT)
    assert orig == (4000, 3000)
    assert image.size == (1000, 750)  # DCT-scaled by libjpeg (1/4), still >= the target: not decoded whole
    # and reduced after (that gives 666x500 and costs 40% more)
    assert image.mode == "RGB"


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(make_image(400, 200), "JPEG", exif=exif.tobytes())
    image, orig = decode_image(data, 640, LIMIT)
    assert orig == (200, 400)
    assert image.size == (200, 400)


@pytest.mark.parametrize(
    "mode,fmt",
    [
        ("L", "PNG"),
        ("LA", "PNG"),
        ("RGBA", "PNG"),
        ("P", "PNG"),
        ("CMYK", "JPEG"),
        ("RGB", "WEBP"),
        ("RGB", "BMP"),
        ("1", "PNG"),
    ],
)
def test_every_colour_mode_becomes_rgb(mode, fmt):
    data = encode(make_image(120, 80, mode=mode), fmt)
    image, orig = decode_image(data, 640, LIMIT)
    assert image.mode == "RGB" and orig == (120, 80)


def test_palette_transparency_is_composited_on_the_pad_grey():
    image = Image.new("P", (10, 10), 0)
    image.putpalette([255, 0, 0] + [0, 0, 0] * 255)
    data = encode(image, "PNG", transparency=0)
    decoded, _ = decode_image(data, 640, LIMIT)
    assert decoded.getpixel((5, 5)) == (114, 114, 114)


def test_sixteen_bit_images_keep_their_contrast():
    values = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16
    data = encode(Image.fromarray(values), "PNG")
    decoded, _ = decode_image(data, 640, LIMIT)
    channel = np.asarray(decoded)[..., 0]
    assert decoded.mode == "RGB" and channel.min() == 0 and channel.max() >= 250


def test_animated_gif_uses_its_first_frame():
    frames = [Image.new("RGB", (32, 32), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    decoded, _ = decode_image(buffer.getvalue(), 640, LIMIT)
    red, _, blue = decoded.getpixel((16, 16))
    assert red > 200 and blue < 50


def test_corrupt_data_raises_decode_error():
    data = encode(make_image(200, 200), "JPEG")[:200] + b"\x00" * 50
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(data, 640, LIMIT)
    assert caught.value.code == "decode_error"


def test_declared_dimensions_over_the_limit_are_refused_before_decoding():
    data = encode(make_image(3000, 3000), "PNG", compress_level=1)
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(data, 640, max_pixels=1_000_000)
    assert caught.value.code == "image_too_large"


def test_the_pixel_limit_is_the_services_alone_raised_or_lowered():
    """Issue 53: with decode.max_image_pixels at 150 M, a 12000x10000 PNG failed with Pillow's own limit
    (89,478,485) in Pillow's words. One limit now, the setting's, and one message naming it."""
    buffer = io.BytesIO()
    Image.new("1", (12000, 10000)).save(buffer, "PNG")  # 120 MP in 14 KB: decodes to 15 MB
    data = buffer.getvalue()
    image, size = decode_image(data, 640, max_pixels=150_000_000)
    assert size == (12000, 10000) and max(image.size) >= 640
    assert Image.MAX_IMAGE_PIXELS == 150_000_000  # Pillow's later checks (a GIF's frames) follow the setting
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(data, 640, max_pixels=80_000_000)
    assert caught.value.code == "image_too_large"
    assert str(caught.value) == ("image of 12000x10000 pixels exceeds the limit of 80000000 (decode.max_image_pixels)")
    with pytest.raises(ImageDecodeError) as caught:  # over twice the limit: Pillow's error, not its warning
        decode_image(data, 640, max_pixels=1_000_000)
    assert str(caught.value).startswith("image of 12000x10000 pixels exceeds the limit of 1000000 ")


def _decode_peak_mb(path: str) -> str:
    """Decode `path` in a fresh interpreter; its peak memory growth in MB, or the refusal."""
    import subprocess
    import sys

    code = (
        "import resource, sys; from tasks.decoding.imaging import decode_image, ImageDecodeError\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"data = open({path!r}, 'rb').read()\n"
        "try:\n    decode_image(data, 320, 80_000_000, 256 * 1024 * 1024)\n"
        "except ImageDecodeError as exc:\n    print(exc.code); sys.exit()\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)"
    )
    from tests.support import REPO_ROOT

    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()


def test_small_files_that_decode_huge_stay_near_one_decoded_copy_or_are_refused_unread(tmp_path):
    """A 175 KB 16-bit PNG of 8900x8900 took 1.3 GB (converted at full size); now about its decoded
    size. An RGB one whose pixels exceed the byte cap is refused before any pixel is decoded."""
    import numpy as np

    sixteen = tmp_path / "sixteen.png"
    Image.fromarray(np.tile(np.arange(8900, dtype=np.uint16), (8900, 1))).save(sixteen)
    rgb = tmp_path / "rgb.png"
    Image.new("RGB", (8900, 8900), (10, 20, 30)).save(rgb)
    assert float(_decode_peak_mb(str(sixteen))) < 1.5 * 8900 * 8900 * 2 / 2**20  # 151 MB decoded
    assert _decode_peak_mb(str(rgb)) == "image_too_large"


def test_scans_are_counted_from_the_markers_past_each_scans_data():
    from tasks.decoding.imaging import jpeg_scans
    from tests.support import scan_bomb

    assert jpeg_scans(jpeg(64, 48), 100) == 1
    progressive = encode(make_image(640, 480), "JPEG", progressive=True)
    assert 5 <= jpeg_scans(progressive, 100) <= 15
    assert jpeg_scans(scan_bomb(256, 256, 500), 10**6) == 506
    assert jpeg_scans(scan_bomb(256, 256, 500), 100) == 101  # stops once past the limit
    # Other segments may hold the SOS marker's two bytes: the upper bound is over the limit, the count is not.
    image = jpeg(64, 48)
    with_comment = image[:2] + b"\xff\xfe" + (2 + 300).to_bytes(2, "big") + b"\xff\xda" * 150 + image[2:]
    assert jpeg_scans(with_comment, 100) == 1
    assert decode_image(with_comment, 32, 10**8)[0].size[0] >= 32


@pytest.mark.parametrize(
    "width, height, repeats, says",
    [
        (8192, 8192, 20_000, "more than 100 scans"),  # the outside check's bomb: 2.2 MB, 20,006 scans
        (8192, 8192, 60, "pixel-scans"),  # within the scans' limit, over the work's
    ],
)
def test_a_scan_bomb_fails_before_it_is_decoded(width, height, repeats, says):
    from tests.support import scan_bomb

    with pytest.raises(ImageDecodeError) as caught:
        decode_image(scan_bomb(width, height, repeats), 320, 10**8, 10**9)
    assert caught.value.code == "image_too_complex" and says in str(caught.value)


def test_a_progressive_photo_within_the_limits_decodes():
    image, size = decode_image(encode(make_image(1920, 1080), "JPEG", progressive=True), 320, 10**8)
    assert size == (1920, 1080) and image.size == (480, 270)  # its scans counted, then draft mode as for any


def test_a_baseline_jpeg_whose_scan_repeats_is_refused_by_the_decoder_itself():
    """Why only progressive JPEGs have their scans counted: libjpeg refuses a repeated baseline scan at once."""
    from tests.support import jpeg_segments

    flat = encode(Image.new("L", (2048, 2048), 128), "JPEG", quality=90)
    segments = jpeg_segments(flat)
    scan = next(segment for marker, segment in segments if marker == 0xDA)
    head = b"".join(segment for marker, segment in segments if marker not in (0xDA, 0xD9))
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(b"\xff\xd8" + head + scan * 200 + b"\xff\xd9", 320, 10**8)
    assert caught.value.code == "decode_error"


def test_an_arithmetic_coded_jpeg_past_one_read_block_decodes_as_its_huffman_twin():
    """libjpeg's arithmetic decoder cannot suspend for more data, and Pillow fed it 64 KB at a time: such a JPEG of
    more than one block failed "broken data stream" (issue 59). The two files hold the same coefficients
    (`jpegtran -arithmetic` of the other, 86 KB): they decode to the same pixels."""
    from tasks.decoding.imaging import arithmetic_coded
    from tests.support import REPO_ROOT

    arithmetic = (REPO_ROOT / "tests" / "data" / "arithmetic-480x270.jpg").read_bytes()
    huffman = (REPO_ROOT / "tests" / "data" / "huffman-480x270.jpg").read_bytes()
    assert len(arithmetic) > 64 * 1024 and arithmetic_coded(arithmetic) and not arithmetic_coded(huffman)
    image, size = decode_image(arithmetic, 640, 10_000_000)
    twin, twin_size = decode_image(huffman, 640, 10_000_000)
    assert size == twin_size == (480, 270)
    assert np.array_equal(np.asarray(image), np.asarray(twin))
