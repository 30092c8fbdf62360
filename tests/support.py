"""Test helpers: images made in memory, a detector with known answers, and
handles on real processes (Redis, Celery worker, GPU worker, API server)."""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import redis
from PIL import Image, ImageDraw

REPO_ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.05,
               what: str = "condition") -> T:
    """Poll with a deadline; the value of the first truthy call, else AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
def build_content_box_model(num_classes: int = 2, pad_value: int = 114, layout: str = "yolov8"):
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
            content = (x - self.pad).abs().amax(dim=1) > 1.5 / 255.0          # [B, H, W]
            cols = content.any(dim=1)                                         # [B, W]
            rows = content.any(dim=2)                                         # [B, H]
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
                return torch.cat([box, obj, scores], dim=1).unsqueeze(1)      # [B, 1, 5 + C]
            return torch.cat([box, scores], dim=1).unsqueeze(2)               # [B, 4 + C, 1]

    return torch.jit.script(ContentBox())


# --- processes --------------------------------------------------------------
class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port)
        wait_until(lambda: _pings(client), 10, what="redis-server to answer")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


class ManagedProcess:
    """A real child process with its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.alive():
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self._log.close()
        return self.process.returncode

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tasks.worker", *args]


class ApiServer:
    """The real Flask app behind a real threaded HTTP server, in this process."""

    def __init__(self, app) -> None:
        from werkzeug.serving import make_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server("127.0.0.1", self.port, app, threaded=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
