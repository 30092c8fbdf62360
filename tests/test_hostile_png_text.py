"""Issue 59, finding 3: a PNG's text chunks outside the decode's memory cap. Pillow capped them at 64 Mi characters,
and CPython stores a string with one character outside the BMP at 4 bytes each: a 68 KB 1x1 PNG of 64 deflated
iTXt chunks held +264 MB (read at open, before the memory check), and the honest 8192x8192 RGBA PNG with the same
text +536 MB against the 256 MiB cap (this machine, 2026-12-06; docs/security.md). Each file is decoded as a CPU
worker decodes it, in a fresh interpreter whose peak memory (VmHWM) from before the open is the figure."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zlib

import pytest
from PIL import Image, PngImagePlugin

from bench.hostile import files as hostile
from tasks.decoding import png_text
from tasks.decoding.imaging import ImageDecodeError, decode_image
from tasks.decoding.structure import DEFAULT_LIMITS, MAX_PNG_TEXT_BYTES, check
from tests.support import REPO_ROOT, encode, make_image

CAP = 256 * 1024 * 1024  # decode.max_decoded_bytes' default

# The decode as a CPU worker's (its malloc, target 640), measured from before the file is opened: the text a PNG
# carries before its image data is read by the open itself.
_MEASURE = r"""
import json, sys, time
from contract.runtime.memory import keep_freed_memory
keep_freed_memory()
from tasks.decoding.imaging import ImageDecodeError, decode_image

def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024

data = sys.stdin.buffer.read()
base, started = hwm(), time.process_time()
try:
    decode_image(data, 640, 80_000_000, int(sys.argv[1]))
    outcome, reason = "decoded", ""
except ImageDecodeError as exc:
    outcome, reason = exc.code, str(exc)
print(json.dumps({"outcome": outcome, "reason": reason, "cpu_s": time.process_time() - started,
                  "growth": hwm() - base}))
"""


def measured(data: bytes, cap: int = CAP) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(cap)], input=data, cwd=REPO_ROOT, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "build, before",
    [
        (hostile.png_text_bomb, "1x1, 68 KB: decoded, +264 MB"),
        (hostile.png_rgba_text_bomb, "8192x8192 RGBA, 343 KB: decoded, +536 MB"),
    ],
)
def test_a_png_whose_text_would_hold_hundreds_of_mb_fails_fast_holding_nothing(build, before):
    got = measured(build())
    assert got["outcome"] == "image_too_complex" and "PNG text chunks" in got["reason"], got
    assert got["cpu_s"] < 0.5 and got["growth"] < 20 * 2**20, got


def test_one_text_chunk_larger_than_the_limit_is_refused_uncopied():
    """12 MiB of plain tEXt: refused by its length, before the walk copies a byte of it."""
    head = encode(make_image(64, 48), "PNG")
    data = head[:33] + hostile.png_chunk(b"tEXt", b"Comment\0" + b"x" * (12 * 2**20)) + head[33:]
    got = measured(data)
    assert got["outcome"] == "image_too_complex" and "PNG text chunks" in got["reason"], got
    assert got["cpu_s"] < 0.5 and got["growth"] < 8 * 2**20, got


def test_the_job_of_such_a_png_fails_with_its_reason():
    """The CPU worker's job error: `image_too_complex`, saying which limit, before Pillow reads a chunk."""
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(hostile.png_text_bomb(), 320, 10**8)
    assert caught.value.code == "image_too_complex"
    assert f"more than {MAX_PNG_TEXT_BYTES} bytes" in str(caught.value) and "orientation" in str(caught.value)


def test_text_under_the_limit_is_counted_in_the_decodes_peak():
    """One such chunk (4 MiB held) is under the text limit: beside 1x1 pixels it decodes, holding about what was
    counted; beside the 8192x8192 RGBA image (the cap's 256 MiB by its pixels) it is over the cap, refused unread."""
    one = hostile.png_text_bomb(chunks=1)
    found = check(one, "PNG", DEFAULT_LIMITS)
    assert 4 * 2**20 - 16 <= found.text_bytes <= 4 * 2**20
    got = measured(one)
    assert got["outcome"] == "decoded" and got["growth"] <= found.text_bytes + 8 * 2**20, got
    big = measured(hostile.png_text_bomb(hostile.png_rgba(), chunks=1))
    assert big["outcome"] == "image_too_large" and "bytes of PNG text chunks" in big["reason"], big
    assert big["growth"] < 20 * 2**20, big


def test_an_ordinary_png_with_a_little_text_still_decodes():
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", "imgserve test")
    info.add_text("Comment", "a note", zip=True)
    info.add_itxt("Description", "ein Bild, \u00fcberall \u2713", lang="de", zip=True)
    buffer = io.BytesIO()
    make_image(640, 480).save(buffer, "PNG", pnginfo=info)
    data = buffer.getvalue()
    found = check(data, "PNG", DEFAULT_LIMITS)
    assert 0 < found.text_bytes < 200
    image, size = decode_image(data, 320, 10**8)
    assert size == (640, 480) and image.mode == "RGB"
    got = measured(data)
    assert got["outcome"] == "decoded" and got["growth"] < 20 * 2**20, got


def test_held_bytes_counts_each_chunk_as_cpython_and_pillow_keep_it():
    ascii_text, wide, astral = b"a" * 1000, "\u0100".encode() * 500, "\U0001f600".encode() * 250
    assert png_text.held_bytes(b"tEXt", b"Comment\0" + ascii_text) == 1000
    assert png_text.held_bytes(b"tEXt", b"exif\0" + ascii_text) == 2000  # kept as bytes too
    assert png_text.held_bytes(b"zTXt", b"Comment\0\0" + zlib.compress(ascii_text)) == 1000
    assert png_text.held_bytes(b"zTXt", b"Comment\0\1" + zlib.compress(ascii_text)) == 0  # Pillow refuses it
    assert png_text.held_bytes(b"zTXt", b"Comment\0\0not zlib") == 0  # Pillow drops it

    def itxt(key: bytes, value: bytes, compressed: bool) -> bytes:
        return hostile.png_itxt(key, value, compressed)[8:-4]

    assert png_text.held_bytes(b"iTXt", itxt(b"k", ascii_text, False)) == 1000
    assert png_text.held_bytes(b"iTXt", itxt(b"k", wide, True)) == 1000 * 2  # 1,000 bytes, 2 bytes a character
    assert png_text.held_bytes(b"iTXt", itxt(b"k", astral, True)) == 1000 * 4
    assert png_text.held_bytes(b"iTXt", itxt(b"XML:com.adobe.xmp", ascii_text, True)) == 2000
    # Inflated at most as far as Pillow's cap a chunk (past it Pillow refuses the file).
    huge = zlib.compress(b"a" * (3 * png_text.TEXT_CHUNK_BYTES))
    assert png_text.held_bytes(b"zTXt", b"k\0\0" + huge) == png_text.TEXT_CHUNK_BYTES


def test_what_the_walk_counts_is_what_pillow_holds():
    """The count against what Pillow's `info` holds once the file is opened: its strings at CPython's own size
    (sys.getsizeof, less a string's fixed part). The walk counts a value's UTF-8 bytes at its widest character's
    width: never less, at most 3 bytes a character past the BMP over."""
    data = hostile.png_text_bomb(encode(make_image(64, 48), "PNG"), chunks=3, chars=100_000)
    counted = check(data, "PNG", DEFAULT_LIMITS).text_bytes
    image = Image.open(io.BytesIO(data), formats=["PNG"])
    held = sum(sys.getsizeof(str(image.info[f"k{i}"])) - sys.getsizeof("\U0001f600") + 4 for i in range(3))
    assert held <= counted <= held + 3 * 16 and counted == 3 * 100_000 * 4


@pytest.mark.integration
def test_through_the_stack_the_job_fails_with_its_reason_and_no_cpu_child_grows(stack):
    """The two files of the issue submitted as a tenant would: each job `failed`, `image_too_complex` naming the
    PNG text, within seconds; the CPU children's peak (VmHWM) grows by less than 50 MB (before: +264 and +536 MB
    decoded, in-process figures), and an ordinary PNG with text, sent after them, succeeds."""
    from tests.test_hostile_clients import _children_peak_rss_kb

    def submit(data: bytes) -> str:
        response = stack.submit(data, content_type="image/png")
        assert response.status_code == 202, response.text
        return response.json()["id"]

    stack.wait_terminal(submit(encode(make_image(320, 240), "PNG")))  # the pool has decoded an image: warm
    before = _children_peak_rss_kb(stack.cpu_worker.process.pid)
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", "imgserve test")
    buffer = io.BytesIO()
    make_image(320, 240, seed=3).save(buffer, "PNG", pnginfo=info)
    jobs = [submit(data) for data in (hostile.png_text_bomb(), hostile.png_rgba_text_bomb())]
    ordinary = submit(buffer.getvalue())
    ended = [stack.wait_terminal(job_id, timeout_s=30) for job_id in jobs]
    assert [(doc["status"], doc["error"]["code"]) for doc in ended] == [("failed", "image_too_complex")] * 2
    assert all("PNG text chunks" in doc["error"]["message"] for doc in ended), ended
    assert stack.wait_terminal(ordinary, timeout_s=30)["status"] == "succeeded"
    after = _children_peak_rss_kb(stack.cpu_worker.process.pid)
    assert after.keys() == before.keys(), "a CPU child was replaced"
    assert all(after[pid] - before[pid] < 50 * 1024 for pid in after), (before, after)
