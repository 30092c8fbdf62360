"""BMP RLE8 and RLE4 pixel data, decoded as Pillow 12's BmpRleDecoder decodes it, with every pixel written at C speed.

Pillow's decoder is Python, and some of its steps cost a pixel each whatever the file says: an end of line pads the
row a byte at a time, an RLE4 run is written a nibble at a time, so a tiny file of a very wide image costs seconds
of CPU (docs/benchmarks/2026-12-06-hostile-round-five.md). Here each command of the file is one Python step, and
what it writes (a run, a skip, a row's padding) is a slice: the cost grows with the file's commands, not its
pixels. Pillow's rules are kept as they are, quirks included (a delta reads four bytes after its escape, an RLE4
absolute run of an odd count drops its last pixel, `x` counts an absolute run's pixels whether or not they fit the
row), so an image decodes to the same pixels here as there (tests.test_hostile_decode compares them).

The commands are bounded: past `decode.max_rle_commands` the decode stops, `image_too_complex` (the bound is far
above an honest RLE image's few thousand, and far below what costs a CPU worker seconds).
"""

from __future__ import annotations

from contextvars import ContextVar

from PIL import Image, ImageFile

from tasks.decoding.structure import DEFAULT_LIMITS, TooComplex

# The commands one decode may take: decode_image sets its limits' for the decodes it runs.
MAX_COMMANDS: ContextVar[int] = ContextVar("max_rle_commands", default=DEFAULT_LIMITS.max_rle_commands)

_RUNS8 = [memoryview(bytes((value,)) * 255) for value in range(256)]  # a run of one byte, sliced to its count
_RUNS4 = [memoryview(bytes((value >> 4, value & 0x0F)) * 128) for value in range(256)]  # two nibbles, alternating
_HIGH = bytes(value >> 4 for value in range(256))
_LOW = bytes(value & 0x0F for value in range(256))


def decode_rle(
    data: bytes, start: int, width: int, height: int, rle4: bool, max_commands: int = 1_000_000
) -> tuple[bytearray, int]:
    """The pixels (a byte each, bottom row first as stored) of RLE data `data`, which starts at offset `start` of
    its file (absolute runs are padded to an even offset of the file, as Pillow seeks), and how many of them
    Pillow's decoder would have produced (fewer than width * height: the data ended early). TooComplex past
    `max_commands` commands: each is a Python step."""
    wanted = width * height
    out = bytearray(wanted)  # zeros: what Pillow appends for an end of line or a delta
    runs = _RUNS4 if rle4 else _RUNS8
    written = x = pos = commands = 0
    size = len(data)
    while written < wanted and pos + 2 <= size:
        commands += 1
        if commands > max_commands:
            raise TooComplex(
                f"a BMP of more than {max_commands} RLE commands (decode.max_rle_commands); refused while decoding"
            )
        count, value = data[pos], data[pos + 1]
        pos += 2
        if count:  # encoded: `count` pixels of `value` (RLE4: its two nibbles in turn), clipped at the row's end
            if x + count > width:
                count = max(0, width - x)
            end = min(wanted, written + count)
            out[written:end] = runs[value][: end - written]
            written += count
            x += count
        elif value == 0:  # end of line: zeros to the next row's start (none when at one)
            written += -written % width
            x = 0
        elif value == 1:  # end of bitmap
            break
        elif value == 2:  # delta: Pillow checks two bytes, then reads two more and unpacks those
            if pos + 2 > size:
                break
            pos += 2
            if pos + 2 > size:
                raise ValueError("not enough values to unpack (expected 2)")
            written += data[pos] + data[pos + 1] * width
            pos += 2
            x = written % width
        else:  # absolute: `value` pixels as they stand (RLE4: value // 2 bytes, two pixels each)
            wanted_bytes = value // 2 if rle4 else value
            chunk = data[pos : pos + wanted_bytes]
            pos += len(chunk)
            pixels: bytes | bytearray = chunk
            if rle4:
                pixels = bytearray(2 * len(chunk))
                pixels[0::2] = chunk.translate(_HIGH)
                pixels[1::2] = chunk.translate(_LOW)
            if written < wanted:
                out[written : min(wanted, written + len(pixels))] = pixels[: wanted - written]
            written += len(pixels)
            if len(chunk) < wanted_bytes:
                break
            x += value
            if (start + pos) % 2:  # to a 16-bit boundary of the file
                pos += 1
    return out, min(written, wanted)


class RleDecoder(ImageFile.PyDecoder):
    """Pillow's "bmp_rle" decoder, the same arguments (raw mode, RLE4, direction) and the same outcome."""

    _pulls_fd = True

    def decode(self, buffer: bytes | Image.SupportsArrayInterface) -> tuple[int, int]:
        assert self.fd is not None
        start = self.fd.tell()
        data = self.fd.read()  # the rest of the file: bounded by the upload
        pixels, produced = decode_rle(
            data, start, self.state.xsize, self.state.ysize, bool(self.args[1]), MAX_COMMANDS.get()
        )
        rawmode = "L" if self.mode == "L" else "P"
        # Fewer pixels than the image has: the raw decoder says "not enough image data", as Pillow's would.
        self.set_as_raw(memoryview(pixels)[:produced], rawmode, (0, self.args[-1]))  # type: ignore[arg-type]
        return -1, 0


def install() -> None:
    """Decode BMP RLE with RleDecoder in this process (Pillow keeps one table of decoders by name, and the BMP
    plugin enters its own when it is imported: imported first here, so that it cannot come after)."""
    from PIL import BmpImagePlugin  # noqa: F401  # registers Pillow's decoder, replaced below

    Image.register_decoder("bmp_rle", RleDecoder)
