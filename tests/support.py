"""Test helpers: images made in memory, a detector with known answers, and
handles on real processes (Redis, Celery worker, GPU worker, API server)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from PIL import Image, ImageDraw

from bench.hostile.files import jpeg_segments, scan_bomb  # noqa: F401   (the scan bomb's tests use them)
from bench.stack.processes import (  # noqa: F401
    REPO_ROOT,
    ManagedProcess,
    RedisServer,
    callback_worker_argv,
    celery_argv,
    free_port,
    python_argv,
    stop_together,
    wait_until,
)


# --- images ---------------------------------------------------------------
def make_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A busy picture with no pixel equal to the pad grey at its borders."""
    image = Image.new("RGB", (width, height), (20 + seed % 50, 90, 200))
    draw = ImageDraw.Draw(image)
    for i in range(6):
        x, y = (i * 37 + seed * 13) % max(1, width), (i * 53 + seed * 7) % max(1, height)
        draw.ellipse((x, y, x + width // 4, y + height // 4), fill=(250, 40 * i % 255, 10))
    return image.convert(mode) if mode != "RGB" else image


def encode(image: Image.Image, fmt: str = "JPEG", **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def jpeg(width: int, height: int, seed: int = 0, quality: int = 92) -> bytes:
    return encode(make_image(width, height, seed=seed), "JPEG", quality=quality)


# --- a detector whose answer is known -------------------------------------
def build_content_box_model(num_classes: int = 2, pad_value: int = 114, layout: str = "yolov8", script: bool = True):
    """TorchScript detector that finds the letterboxed content: one box around
    every pixel that differs from the pad grey. Mapped back through the
    letterbox it must equal the whole original image, [0, 0, W, H]."""
    import torch

    class ContentBox(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pad = pad_value / 255.0
            self.num_classes = num_classes
            self.yolov5 = layout == "yolov5"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, _, h, w = x.shape
            content = (x - self.pad).abs().amax(dim=1) > 1.5 / 255.0  # [B, H, W]
            cols = content.any(dim=1)  # [B, W]
            rows = content.any(dim=2)  # [B, H]
            xs = torch.arange(w, device=x.device, dtype=torch.float32)
            ys = torch.arange(h, device=x.device, dtype=torch.float32)
            x1 = torch.where(cols, xs, float(w)).amin(dim=1)
            x2 = torch.where(cols, xs + 1, 0.0).amax(dim=1)
            y1 = torch.where(rows, ys, float(h)).amin(dim=1)
            y2 = torch.where(rows, ys + 1, 0.0).amax(dim=1)
            box = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=1)  # [B, 4]
            scores = torch.zeros(b, self.num_classes, device=x.device)
            scores[:, 0] = 0.9
            if self.yolov5:
                obj = torch.ones(b, 1, device=x.device)
                return torch.cat([box, obj, scores], dim=1).unsqueeze(1)  # [B, 1, 5 + C]
            return torch.cat([box, scores], dim=1).unsqueeze(2)  # [B, 4 + C, 1]

    return torch.jit.script(ContentBox()) if script else ContentBox()


# --- processes (the rest live in bench.stack.processes) ------------------------
class ApiServer:
    """The real Flask app behind a real threaded HTTP server, in this process."""

    def __init__(self, app) -> None:
        from werkzeug.serving import make_server

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server("127.0.0.1", self.port, app, threaded=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        from app.services import services

        self.server.shutdown()
        services(self.app).cells.close()


@contextlib.contextmanager
def api_with_keys(settings: Any, api_keys: tuple[dict[str, str], ...], **auth: Any) -> Iterator[ApiServer]:
    """The real app with `settings` but these API keys (and `auth`'s other settings: a rate, a burst) behind an
    ApiServer, stopped after: the fixture every test of keyed access starts from."""
    from app import create_app

    changed = dataclasses.replace(settings.auth, api_keys=api_keys, **auth)
    server = ApiServer(create_app(dataclasses.replace(settings, auth=changed)))
    try:
        yield server
    finally:
        server.stop()


# The aten operations that make the host wait for the device on CUDA (sync_debug_mode reports them):
# a scalar read (`item()`, `bool()`, `int()`), data-dependent shapes, and a whole-tensor comparison.
HOST_READS = frozenset(
    {
        "item",
        "_local_scalar_dense",
        "is_nonzero",
        "nonzero",
        "nonzero_numpy",
        "argwhere",
        "equal",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "repeat_interleave",
    }
)


class HostReads:
    """Counts, on any device, the operations that make the host wait for the device on CUDA
    (HOST_READS): what torch.cuda.set_sync_debug_mode reports there, except
    plain copies to the host, which a CPU tensor never makes."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __enter__(self) -> HostReads:
        from torch.utils._python_dispatch import TorchDispatchMode

        names = self.names

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func.overloadpacket.__name__ in HOST_READS:
                    names.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self._mode = Counting()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def __len__(self) -> int:
        return len(self.names)


FUZZ_EXAMPLES = 60  # schemathesis's examples per operation and phase (100 took 50-80 s a run on 2 busy cores)


def run_schemathesis(base_url: str, *extra: str) -> subprocess.CompletedProcess:
    """The schemathesis CLI, as a user would run it: every check, every phase (tests/test_openapi*.py)."""
    argv = [
        str(Path(sys.executable).with_name("schemathesis")),
        "--config-file",
        str(REPO_ROOT / "schemathesis.toml"),
        "run",
        base_url + "/openapi.json",
        "--max-examples",
        str(FUZZ_EXAMPLES),
        "--workers",
        "1",  # with 2, CPython 3.11 raised
        # "SystemError: AST constructor recursion depth mismatch" now and then (two threads compiling at once)
        "--request-timeout",
        "20",
        *extra,
    ]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO_ROOT,  # the config's hooks path
        env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_HOOKS": ""},
    )


def answers_200(url: str) -> bool:
    """Whether `url` answers 200 now: a poll's predicate while a server starts (anything else, or no answer, is
    not yet)."""
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def as_key(key: str | None) -> dict[str, str]:
    """The headers a request makes as the holder of API key `key` (none: no key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}
