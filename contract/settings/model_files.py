"""What a model file is, and what it says about itself, read without torch.

The CPU workers letterbox for the model's input size and the API lists its
labels, and neither imports torch: both read the spec, which may take those
from the file itself. Ultralytics' and YOLOv5's TorchScript exports carry a
JSON `config.txt` among the archive's extra files (`names`, `imgsz`, `stride`,
`task`, ...); a spec that leaves `labels` or `input_size` out gets them from
there, so a 320 export is no longer run at 640 by accident.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

# What `identify` answers, and how to say it to someone who named the file.
KINDS = {
    "torchscript": "a TorchScript archive (torch.jit.save; format: torchscript)",
    "export": "a torch.export program (.pt2, torch.export.save; format: export)",
    "checkpoint": "a PyTorch checkpoint (torch.save: weights or a pickled module, e.g. an Ultralytics .pt), "
    "not a program this service can run: export it to TorchScript or .pt2 first",
    "onnx": "an ONNX model, which this service does not run: export the PyTorch model to TorchScript or .pt2 instead",
    "safetensors": "a safetensors weights file (weights without the network): export the model to "
    "TorchScript or .pt2 instead",
    "zip": "a ZIP archive, but not a TorchScript or torch.export one",
    "unknown": "not a file this service recognises (TorchScript and torch.export .pt2 are served)",
}

# The first field of an ONNX ModelProto is ir_version (field 1, varint: tag 0x08); the next is one of
# producer_name .. opset_import (fields 2-8, tags 0x12, 0x1a, 0x22, 0x28, 0x32, 0x3a, 0x42).
_ONNX_NEXT_TAGS = {0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42}


class ModelFileError(ValueError):
    """A model file that does not say what its spec needs."""


def identify(path: Path) -> str:
    """One of KINDS' keys, from the file's bytes (never its name)."""
    with open(path, "rb") as file:
        head = file.read(64)
    if head.startswith(b"PK\x03\x04"):
        return _archive_kind(path)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):  # a pickle: legacy torch.save
        return "checkpoint"
    if _looks_like_onnx(head):
        return "onnx"
    if len(head) > 9 and head[8:10] == b'{"':  # u64 header length, then a JSON header
        return "safetensors"
    return "unknown"


def describe_kind(kind: str) -> str:
    return KINDS.get(kind, KINDS["unknown"])


def embedded_metadata(path: Path) -> dict[str, Any]:
    """`labels` and `input_size` from a TorchScript archive's `extra/config.txt`, those it gives."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/extra/config.txt")), None)
            if name is None:
                return {}
            config = json.loads(archive.read(name))
    except (OSError, zipfile.BadZipFile, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    found: dict[str, Any] = {}
    if "names" in config:
        found["labels"] = _labels(config["names"])
    size = config.get("imgsz", (config.get("shape") or [None] * 4)[2:] or None)  # YOLOv5: shape [B, 3, H, W]
    if size is not None:
        found["input_size"] = _square_size(size)
    return found


def _labels(names: Any) -> tuple[str, ...]:
    """Ultralytics writes {0: "person", ...} (JSON keys become strings); YOLOv5 may write a list."""
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return tuple(names)
    if isinstance(names, dict):
        try:
            by_index = {int(key): str(value) for key, value in names.items()}
        except (TypeError, ValueError):
            by_index = {}
        if by_index and sorted(by_index) == list(range(len(by_index))):
            return tuple(by_index[i] for i in range(len(by_index)))
    raise ModelFileError(f"the file's config.txt names its classes in a form not understood: {str(names)[:80]}")


def _square_size(size: Any) -> int:
    sizes = [size] if isinstance(size, int) else list(size) if isinstance(size, (list, tuple)) else []
    if not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ModelFileError(f"the file's config.txt gives an input size not understood: {size!r}")
    if len(set(sizes)) != 1:
        raise ModelFileError(
            f"the file was exported for a {sizes[-1]}x{sizes[0]} input; this service "
            f"feeds square inputs: re-export it square, or set input_size in the spec"
        )
    return sizes[0]


def _archive_kind(path: Path) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return "unknown"
    if any(n.endswith("/archive_format") or "/models/" in n for n in names):
        return "export"
    if any("/code/" in n or n.endswith("/constants.pkl") for n in names):
        return "torchscript"
    if any(n.endswith("data.pkl") for n in names):
        return "checkpoint"
    return "zip"


def _looks_like_onnx(head: bytes) -> bool:
    if len(head) < 3 or head[0] != 0x08:
        return False
    # ir_version is a small varint (1..15 so far): one byte, then the next field's tag.
    return 1 <= head[1] <= 15 and head[2] in _ONNX_NEXT_TAGS
