"""Issue 40's decoder findings, as attacks on the CPU worker's decode: each hostile file is built here
(bench.hostile.files), decoded, and must be refused with its reason, in bounded CPU time and memory.
The figures before the fix (this machine, 2026-12-05) are in each test's docstring; docs/security.md has
the table."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from PIL import Image, ImageOps, PngImagePlugin

from bench.hostile import files as hostile
from contract.settings import DecodeSettings
from tasks.decoding.imaging import ImageDecodeError, decode_image
from tasks.decoding.structure import DEFAULT_LIMITS, StructureLimits, TooComplex, check
from tests.support import REPO_ROOT, encode, jpeg, make_image

CPU_BOUND_S = 2.0  # the target per hostile file; the decodes take milliseconds
MEMORY_BOUND = 100 * 1024 * 1024  # what a CPU worker child may grow by above a normal decode


def attack(data: bytes, limits: StructureLimits = DEFAULT_LIMITS) -> tuple[ImageDecodeError, float, int]:
    """Decode `data` as a CPU worker does; (the refusal, CPU seconds, peak Python memory in bytes). Time and
    memory are measured in separate runs (tracemalloc slows Python down)."""
    started = time.process_time()
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(data, 320, 80_000_000, 256 * 1024 * 1024, structure=limits)
    cpu_s = time.process_time() - started
    tracemalloc.start()
    try:
        with pytest.raises(ImageDecodeError):
            decode_image(data, 320, 80_000_000, 256 * 1024 * 1024, structure=limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return caught.value, cpu_s, peak


def assert_refused(data: bytes, code: str, says: str) -> None:
    refusal, cpu_s, peak = attack(data)
    assert refusal.code == code and says in str(refusal), str(refusal)
    assert cpu_s < CPU_BOUND_S, f"{cpu_s:.2f} s of CPU"
    assert peak < MEMORY_BOUND, f"{peak / 2**20:.0f} MB"


def test_a_gif_of_400k_comment_extensions_is_refused_before_pillow_joins_them():
    """Before: 5.4 s of CPU here (7.9 s on the probe's machine), growing with the square of the comments."""
    bomb = hostile.gif_comment_bomb(400_000)
    assert len(bomb) > 2_000_000
    assert_refused(bomb, "image_too_complex", "comment blocks")


def test_a_jpeg_whose_exif_entries_all_point_at_the_whole_segment_is_refused():
    """Before: a 66 KB JPEG grew the decoding process by 342 MB (Pillow reads the EXIF while opening it)."""
    bomb = hostile.jpeg_exif_bomb()
    assert len(bomb) < 70_000
    assert_refused(bomb, "image_too_complex", "decode.max_exif_tags (1000)")


def test_exif_entries_within_the_tag_limit_that_overlap_are_refused_for_the_bytes_they_ask_for():
    bomb = hostile.jpeg_with_app1(hostile.overlapping_exif(65_533, tags=500))  # 500 x 64 KB = 32 MB
    assert_refused(bomb, "image_too_complex", "decode.max_exif_bytes (262144)")


def test_a_png_exif_chunk_of_250_tags_each_pointing_at_8_mb_is_refused():
    """Before: 2.0 GB more for the decoding process (250 copies of the 8 MB chunk), 4.1 s."""
    bomb = hostile.png_exif_bomb(8 * 1024 * 1024, tags=250)
    assert_refused(bomb, "image_too_complex", "decode.max_exif_bytes")


def test_a_jpeg_of_20_mb_of_empty_comment_segments_is_refused():
    """Before: 6.1 s and 372 MB here (11.4 s on the probe's machine): 5 million segments read in Python."""
    flood = hostile.jpeg_comment_flood(20 * 1024 * 1024)
    assert len(flood) > 20_000_000
    assert_refused(flood, "image_too_complex", "JPEG segments")


def test_a_png_of_1_6_million_empty_chunks_is_refused():
    """Before: 5.7 s and 173 MB here (14.8 s on the probe's machine)."""
    flood = hostile.png_chunk_flood(19 * 1024 * 1024)
    assert (len(flood) - 100) // 12 > 1_600_000
    assert_refused(flood, "image_too_complex", "PNG chunks")


@pytest.mark.parametrize(
    "build, says, before",
    [
        (hostile.gif_stray_bytes, "GIF blocks", "2.0 s"),
        (hostile.gif_long_comment, "comment blocks", "2.2 s"),
        (hostile.jpeg_photoshop_flood, "JPEG segments", "1.2 s"),
        (hostile.png_profile_flood, "iCCP", "46 s"),
    ],
)
def test_the_same_attacks_by_other_blocks_are_refused(build, says, before):
    """Blocks Pillow also reads a step (or an inflate) at a time; the CPU each cost before is `before`."""
    assert_refused(build(), "image_too_complex", says)


def test_an_mpo_wrapped_scan_bomb_is_counted_as_a_jpeg():
    """Before: 11.3 s for 64 KB: Pillow opens a JPEG with an MPF index as an MPO, and the scan count ran only
    for format "JPEG" (20,000 scans of 8192x8192 would have held the worker to its time limit)."""
    bomb = hostile.mpo_scan_bomb()
    assert Image.open(io.BytesIO(bomb)).format == "MPO"
    assert_refused(bomb, "image_too_complex", "scans")


def test_the_gif_im_polyglot_is_opened_as_a_gif_only():
    """A body that starts GIF89a and is an IM file: Pillow's GIF plugin fails on it, and Image.open without
    formats= fell through to the IM plugin: the job succeeded as a 200x100 image."""
    small = hostile.gif_im_polyglot(20, 10)  # too few stray bytes for the structure's limit: formats= refuses
    assert Image.open(io.BytesIO(small)).format == "IM"  # the bypass, as it was
    refusal, _, _ = attack(small)
    assert refusal.code == "decode_error" and "cannot identify image file" in str(refusal)
    refusal, cpu_s, _ = attack(hostile.gif_im_polyglot())  # the probe's own, 200x100
    assert refusal.code in ("decode_error", "image_too_complex") and cpu_s < CPU_BOUND_S


def test_a_20_mb_file_is_judged_in_well_under_a_second():
    """The walk is a Python step per block up to the limit, and C scans (find, count, a regex) past runs."""
    for flood in (
        hostile.jpeg_comment_flood(20 * 1024 * 1024),
        hostile.png_chunk_flood(20 * 1024 * 1024),
        hostile.gif_stray_bytes(20 * 1024 * 1024),
        hostile.jpeg_photoshop_flood(20 * 1024 * 1024),
    ):
        fmt = {b"\xff": "JPEG", b"\x89": "PNG", b"G": "GIF"}[flood[:1]]
        started = time.process_time()
        with pytest.raises(TooComplex):
            check(flood, fmt, DEFAULT_LIMITS)
        assert time.process_time() - started < 0.5


def _decode_rss_growth_mb(data: bytes) -> tuple[str, float]:
    """Decode in a fresh interpreter: (its outcome, its peak RSS growth in MB): Pillow's C allocations too."""
    code = (
        "import resource, sys; from tasks.decoding.imaging import decode_image, ImageDecodeError\n"
        "data = sys.stdin.buffer.read()\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n    decode_image(data, 320, 80_000_000, 256 * 1024 * 1024); outcome = 'decoded'\n"
        "except ImageDecodeError as exc:\n    outcome = exc.code\n"
        "print(outcome, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=data, cwd=REPO_ROOT, capture_output=True, check=True, timeout=120
    )
    outcome, growth = done.stdout.decode().split()
    return outcome, float(growth)


@pytest.mark.parametrize("build", [hostile.png_exif_bomb, hostile.jpeg_comment_flood])
def test_the_decoding_process_does_not_grow_on_the_bombs_that_grew_it_most(build):
    """2.0 GB and 372 MB before; measured as the process's peak RSS, Pillow's own allocations included."""
    outcome, growth_mb = _decode_rss_growth_mb(build())
    assert outcome == "image_too_complex" and growth_mb < 100


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_exif_orientation_is_read_as_pillow_reads_it_without_pillow_reading_it(fmt):
    """The orientation comes from a bounded parse (tasks.decoding.structure), never Image.getexif(): the same upright
    image as ImageOps.exif_transpose for every value, out-of-range ones included."""
    for orientation in range(10):
        exif = Image.Exif()
        exif[0x0112] = orientation
        data = encode(make_image(120, 80), fmt, exif=exif.tobytes(), **({"lossless": True} if fmt == "WEBP" else {}))
        expected = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        image, size = decode_image(data, 640, 10**8)
        assert size == expected.size and image.size == expected.size, (fmt, orientation)
        assert np.array_equal(np.asarray(image), np.asarray(expected)), (fmt, orientation)


def test_orientation_from_xmp_and_from_imagemagicks_text_chunk_as_pillow_finds_it():
    xmp = PngImagePlugin.PngInfo()
    xmp.add_itxt("XML:com.adobe.xmp", '<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>')
    exif = Image.Exif()
    exif[0x0112] = 8
    hexed = exif.tobytes().hex()
    raw = PngImagePlugin.PngInfo()
    raw.add_text("Raw profile type exif", f"\nexif\n{len(hexed) // 2:8d}\n{hexed}\n")
    jpeg_xmp = encode(make_image(120, 80), "JPEG", xmp=b'<x:xmpmeta tiff:Orientation="5"/>')
    for data in (
        encode(make_image(120, 80), "PNG", pnginfo=xmp),
        encode(make_image(120, 80), "PNG", pnginfo=raw),
        jpeg_xmp,
    ):
        expected = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        assert expected.size == (80, 120)
        assert decode_image(data, 640, 10**8)[1] == (80, 120)


def test_files_within_the_limits_decode_and_the_limits_are_settings():
    """Just under each limit decodes; one over is refused; the defaults are DecodeSettings' own."""
    assert dataclasses.asdict(DEFAULT_LIMITS) == {
        field: getattr(DecodeSettings(), field) for field in dataclasses.asdict(DEFAULT_LIMITS)
    }
    # A comment extension and each of its sub-blocks are a join apiece: 2 for the bomb's one-byte comments.
    assert decode_image(hostile.gif_comment_bomb(500), 320, 10**8)[1] == (64, 48)
    assert attack(hostile.gif_comment_bomb(501))[0].code == "image_too_complex"
    tight = dataclasses.replace(DEFAULT_LIMITS, max_blocks=100)
    photo = jpeg(640, 480)
    assert decode_image(photo, 320, 10**8, structure=tight)[1] == (640, 480)
    commented = photo[:2] + b"\xff\xfe\x00\x02" * 100 + photo[2:]
    assert attack(commented, tight)[0].code == "image_too_complex"
    assert decode_image(commented, 320, 10**8)[1] == (640, 480)


def test_a_photos_exif_and_an_mpo_index_pass_the_walk():
    """Real metadata: a camera-like EXIF (tags with values out of line, an EXIF sub-directory) and an MPF
    index naming two images decode as before."""
    exif = Image.Exif()
    exif.update(
        {0x010F: "Camera maker", 0x0110: "Model 9", 0x0112: 3, 0x0131: "firmware 1.0" * 10, 0x011A: 72.0, 0x011B: 72.0}
    )
    exif.get_ifd(0x8769).update({0x9003: "2026:12:05 10:00:00", 0x927C: b"maker note " * 200})
    data = encode(make_image(400, 300), "JPEG", exif=exif.tobytes())
    image, size = decode_image(data, 640, 10**8)
    assert size == (400, 300) and image.getpixel((399, 299)) == ImageOps.exif_transpose(
        Image.open(io.BytesIO(data))
    ).convert("RGB").getpixel((399, 299))
    mpo = hostile.mpo_scan_bomb(64, 48, 0)  # no repeated scan: an ordinary two-image MPO index
    assert decode_image(mpo, 320, 10**8)[1] == (64, 48)
