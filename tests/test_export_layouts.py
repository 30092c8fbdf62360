"""The detectors users export, each served from one YAML spec: what their files are and say, and,
end to end through real processes, a known answer from every layout.

Ultralytics and YOLOv5 cannot be installed here (they need torchvision, which does not import beside
the pinned torch), so each file is built as their exporters build it: the same output forms (a
tensor; YOLOv5's `(pred,)` and `(pred, [maps])`), the same `config.txt` extra file, fp16 weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from bench.stack.processes import gpu_worker_argv
from contract.settings.config import load_model_spec
from contract.settings.model_files import embedded_metadata, identify
from contract.settings.sections import SettingsError
from gpu_worker.model import ModelLoadError, load_model
from tests.conftest import STACK_INPUT_SIZE, TEST_DEVICE, Stack
from tests.support import ManagedProcess, build_content_box_model, jpeg, wait_until

CPU = torch.device("cpu")
LABELS = ["content", "other"]


class PredictionTuple(torch.nn.Module):
    """YOLOv5's exporter: `(pred,)`."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.inner(x),)


class PredictionAndMaps(PredictionTuple):
    """YOLOv5 traced without its export flag: `(pred, [feature maps])`."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:  # type: ignore[override]
        return self.inner(x), [x[:, :1, ::8, ::8]]


def ultralytics_config(names: Any = None, imgsz: Any = STACK_INPUT_SIZE) -> str:
    """What Ultralytics' TorchScript exporter writes into config.txt (json.dumps of its metadata)."""
    return json.dumps(
        {
            "description": "Ultralytics YOLOv8n model",
            "stride": 32,
            "task": "detect",
            "batch": 1,
            "imgsz": [imgsz, imgsz] if isinstance(imgsz, int) else imgsz,
            "names": names if names is not None else {0: LABELS[0], 1: LABELS[1]},
        }
    )


def write_model(folder: Path, kind: str) -> dict[str, Any]:
    """One export as a user would have it, and the spec that serves it (labels / input_size left out
    where the file carries them)."""
    spec: dict[str, Any] = {"name": kind, "version": "1"}
    if kind == "yolov8-torchscript":  # Ultralytics' exporter: a tensor and config.txt
        path = folder / "yolov8n.torchscript"
        build_content_box_model(2).save(str(path), _extra_files={"config.txt": ultralytics_config()})
        spec.update(format="torchscript", layout="yolov8")
    elif kind in ("yolov5-tuple", "yolov5-tuple-with-maps"):  # YOLOv5's exporter: (pred,) / a trace
        path = folder / "yolov5s.torchscript"
        wrapper = PredictionAndMaps if kind.endswith("maps") else PredictionTuple
        scripted = torch.jit.script(wrapper(build_content_box_model(2, layout="yolov5")))
        v5_config = json.dumps({"shape": [1, 3, STACK_INPUT_SIZE, STACK_INPUT_SIZE], "stride": 32, "names": LABELS})
        torch.jit.save(scripted, str(path), _extra_files={"config.txt": v5_config})
        spec.update(format="torchscript", layout="yolov5")
    elif kind == "pt2-dynamic-batch":
        path = folder / "detector.pt2"
        batch = torch.export.Dim("batch", min=1, max=64)
        program = torch.export.export(
            build_content_box_model(2, script=False),
            (torch.zeros(2, 3, STACK_INPUT_SIZE, STACK_INPUT_SIZE),),
            dynamic_shapes=({0: batch},),
        )
        torch.export.save(program, str(path))
        spec.update(format="export", layout="yolov8", labels=LABELS, input_size=STACK_INPUT_SIZE)
    elif kind == "fp16-torchscript":
        path = folder / "half.torchscript"
        build_content_box_model(2).save(str(path), _extra_files={"config.txt": ultralytics_config()})
        spec.update(format="torchscript", layout="yolov8", precision="fp16")
    else:
        raise ValueError(kind)
    spec["path"] = str(path)
    return spec


KINDS = ["yolov8-torchscript", "yolov5-tuple", "yolov5-tuple-with-maps", "pt2-dynamic-batch", "fp16-torchscript"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_export_loads_from_its_spec_and_answers_at_batch_1_and_8(tmp_path, kind):
    spec = load_model_spec(write_model(tmp_path, kind), tmp_path)
    assert list(spec.labels) == LABELS and spec.input_size == STACK_INPUT_SIZE
    loaded = load_model(spec, CPU, max_batch=8)
    described = loaded.describe()
    assert described["output"] == ("element 0 of a tuple" if "tuple" in kind else "tensor")
    if spec.format == "torchscript":
        assert described["from_file"] == ["labels", "input_size"]
    canvas = torch.full((8, 3, STACK_INPUT_SIZE, STACK_INPUT_SIZE), 114 / 255.0, dtype=loaded.dtype)
    with torch.inference_mode():
        assert loaded.module(canvas).shape[0] == 8


def test_ultralytics_config_gives_labels_in_index_order_and_the_input_size(tmp_path):
    path = tmp_path / "m.torchscript"
    names = {"2": "truck", "0": "person", "1": "car"}
    build_content_box_model(3).save(str(path), _extra_files={"config.txt": ultralytics_config(names, 320)})
    assert embedded_metadata(path) == {"labels": ("person", "car", "truck"), "input_size": 320}


def test_a_spec_keeps_what_it_says_over_the_file(tmp_path):
    spec = write_model(tmp_path, "yolov8-torchscript")
    loaded = load_model_spec({**spec, "input_size": 640, "labels": ["x", "y"]}, tmp_path)
    assert loaded.input_size == 640 and loaded.labels == ("x", "y") and loaded.from_file == ()


def test_a_non_square_export_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "wide.torchscript"
    build_content_box_model(2).save(str(path), _extra_files={"config.txt": ultralytics_config(imgsz=[384, 640])})
    with pytest.raises(SettingsError, match="640x384 input.*square"):
        load_model_spec({"name": "w", "version": "1", "format": "torchscript", "path": str(path)}, tmp_path)


def onnx_bytes() -> bytes:
    """The head of an ONNX ModelProto as torch.onnx writes it: ir_version 8, producer "pytorch" 2.13."""
    return b"\x08\x08\x12\x07pytorch\x1a\x042.13:" + bytes(64)


@pytest.mark.parametrize(
    "content, says",
    [
        (onnx_bytes(), "an ONNX model"),
        (None, "a PyTorch checkpoint"),
        (b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19." + bytes(32), "a PyTorch checkpoint"),  # legacy torch.save
        (b"not a model at all", "not a file this service recognises"),
    ],
)
def test_a_file_of_another_kind_is_named_not_called_corrupted(tmp_path, content, says):
    path = tmp_path / "model.pt"
    if content is None:
        # an Ultralytics .pt: a checkpoint, not a program
        torch.save({"model": build_content_box_model(2).state_dict(), "names": LABELS}, str(path))
    else:
        path.write_bytes(content)
    spec = load_model_spec(
        {"name": "m", "version": "1", "format": "torchscript", "path": str(path), "labels": LABELS, "input_size": 64},
        tmp_path,
    )
    with pytest.raises(ModelLoadError, match=f"is {says}.*the spec says format: torchscript"):
        load_model(spec, CPU)


def test_a_pt2_named_as_torchscript_says_which_format_it_is(tmp_path):
    spec = write_model(tmp_path, "pt2-dynamic-batch")
    assert identify(Path(spec["path"])) == "export"
    with pytest.raises(
        ModelLoadError,
        match=r"torch.export program .*format: export\); the spec says format: "
        r"torchscript",
    ):
        load_model(load_model_spec({**spec, "format": "torchscript"}, tmp_path), CPU)


# --- end to end: the stack's API and CPU workers, a GPU worker per export -------------------------
@pytest.fixture(scope="module")
def swapped_workers(stack: Stack) -> Iterator[list[ManagedProcess]]:
    """The exports' GPU workers of this module, one at a time; the stack's own GPU worker comes back once, after
    the module, not after each test (a start is the model's load and warm-up: seconds each time)."""
    swapped: list[ManagedProcess] = []
    yield swapped
    for process in swapped:
        process.stop()
    if stack.gpu_worker is None:
        stack.start_gpu_worker()


@pytest.fixture
def swap_model(stack: Stack, swapped_workers: list[ManagedProcess], tmp_path: Path) -> Iterator[Any]:
    """Serve another export on the stack: only the GPU worker changes. It serves the export under the
    stack's model name and version (so it takes that model's frames) and at the same input size and
    labels (so the API and the CPU workers need not change); the previous export's worker stops first."""

    def serve(kind: str) -> None:
        config = yaml.safe_load(stack.config_path.read_text())
        config["model"] = {
            **write_model(tmp_path, kind),
            "name": stack.settings.model.name,
            "version": stack.settings.model.version,
        }
        config_path = tmp_path / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        stack.stop_gpu_worker()
        while swapped_workers:
            swapped_workers.pop().stop()
        worker_id = f"{stack.gpu_worker_id}-{kind}"
        process = ManagedProcess(
            f"gpu-worker-{kind}",
            gpu_worker_argv(TEST_DEVICE, worker_id),
            {**stack.env, "IMGSERVE_CONFIG": str(config_path)},
            tmp_path,
        )
        swapped_workers.append(process)
        wait_until(
            lambda: stack.redis.exists(stack.keys.heartbeat(worker_id)) or not process.alive(),
            60,
            what=f"the {kind} GPU worker's first heartbeat",
        )
        assert process.alive(), process.log_tail()

    yield serve


@pytest.mark.parametrize("kind", KINDS)
def test_each_export_is_served_end_to_end(stack, swap_model, kind):
    swap_model(kind)
    job_ids = [
        stack.submit_ok(jpeg(width, height, seed=i))
        for i, (width, height) in enumerate([(640, 480), (300, 500), (1024, 256)])
    ]
    for job_id, (width, height) in zip(job_ids, [(640, 480), (300, 500), (1024, 256)]):
        doc = stack.wait_terminal(job_id)
        assert doc["status"] == "succeeded", doc
        [detection] = doc["result"]["detections"]
        assert detection["label"] == "content"
        assert detection["box"] == pytest.approx([0, 0, width, height], abs=max(width, height) / STACK_INPUT_SIZE + 1)


def test_the_pt2_recipe_writes_a_program_and_a_spec_the_worker_serves(tmp_path):
    """`python -m tools.export_pt2` (a real process): a dynamic batch, checked at 1 and the maximum."""
    import subprocess
    import sys

    out = tmp_path / "models" / "tiny.pt2"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.export_pt2",
            "gpu_worker.tiny_yolo:build_random",
            "--labels",
            "a,b,c",
            "--imgsz",
            "64",
            "--max-batch",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    spec = load_model_spec(str(out.with_suffix(".yaml")), tmp_path)
    assert (spec.format, spec.layout, spec.input_size, spec.labels) == ("export", "yolov8", 64, ("a", "b", "c"))
    loaded = load_model(spec, CPU, max_batch=8)
    with torch.inference_mode():
        assert loaded.module(torch.zeros(5, 3, 64, 64)).shape[:2] == (5, 7)


def test_the_pt2_recipe_says_why_it_cannot_read_an_ultralytics_model_here(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "tools.export_pt2", str(tmp_path / "yolov8n.yaml"), "--out", str(tmp_path / "y.pt2")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "ultralytics" in done.stderr


def test_v1_models_says_what_the_file_gave_and_how_its_output_is_read(stack, swap_model):
    swap_model("yolov5-tuple")
    worker_id = f"{stack.gpu_worker_id}-yolov5-tuple"
    served = wait_until(
        lambda: [
            m
            for m in stack.session.get(stack.url("/v1/models"), timeout=10).json()["models"]
            if m["workers"] == [worker_id]
        ],
        30,
        what="the swapped model in /v1/models",
    )
    assert served[0]["output"] == "element 0 of a tuple"
    assert served[0]["from_file"] == ["labels", "input_size"] and served[0]["precision"] == "fp32"
