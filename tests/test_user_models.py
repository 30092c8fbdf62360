"""A user serves their own detector by writing one YAML spec: TorchScript or torch.export."""

from __future__ import annotations

import pytest
import torch

from contract.settings.config import load_settings
from contract.settings.sections import SettingsError
from gpu_worker.model import ModelLoadError, load_model
from gpu_worker.postprocess import Geometry, Thresholds, postprocess
from tests.support import build_content_box_model

CPU = torch.device("cpu")


class FixedYolov5(torch.nn.Module):
    """Two boxes per image in the YOLOv5 layout [B, N, 5 + C], whatever the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor(
            [[32.0, 32.0, 20.0, 10.0, 0.9, 0.1, 0.8], [10.0, 50.0, 8.0, 8.0, 0.7, 0.9, 0.1]], device=x.device
        )
        return rows.expand(x.shape[0], -1, -1) + x.mean() * 0


def write_spec(tmp_path, body: str):
    (tmp_path / "my-model.yaml").write_text(body)
    (tmp_path / "settings.yaml").write_text("model: my-model.yaml\n")
    return load_settings(tmp_path / "settings.yaml")


def test_torchscript_export_served_from_one_yaml_file(tmp_path):
    build_content_box_model(num_classes=2).save(str(tmp_path / "detector.pt"))
    settings = write_spec(
        tmp_path,
        "name: mine\nversion: '2'\nformat: torchscript\npath: detector.pt\n"
        "input_size: 64\nlayout: yolov8\nlabels: [thing, other]\nconf: 0.5\n",
    )
    loaded = load_model(settings.model, CPU)
    assert settings.model.path == str(tmp_path / "detector.pt")
    assert loaded.describe()["name"] == "mine" and loaded.describe()["labels"] == ["thing", "other"]


def test_torch_export_program_with_a_dynamic_batch(tmp_path):
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(FixedYolov5(), (torch.zeros(2, 3, 64, 64),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "detector.pt2"))
    settings = write_spec(
        tmp_path,
        "name: v5\nversion: '1'\nformat: export\npath: detector.pt2\ninput_size: 64\nlayout: yolov5\nlabels: [a, b]\n",
    )
    loaded = load_model(settings.model, CPU)
    with torch.inference_mode():
        output = loaded.module(torch.zeros(3, 3, 64, 64))
    geometry = Geometry(*(torch.tensor([v] * 3, dtype=torch.float64) for v in (0, 0, 0.5, 0.5, 128, 128)))
    dets = postprocess(
        output, "yolov5", Thresholds(torch.full((3,), 0.5), torch.full((3,), 0.5), torch.full((3,), 10)), geometry
    )
    assert dets.class_ids.tolist() == [1, 0] * 3  # 0.9 * 0.8, then 0.7 * 0.9
    assert dets.boxes[0].tolist() == pytest.approx([44.0, 54.0, 84.0, 74.0])


def test_an_export_with_a_static_batch_is_refused_clearly(tmp_path):
    program = torch.export.export(FixedYolov5(), (torch.zeros(1, 3, 64, 64),))
    torch.export.save(program, str(tmp_path / "static.pt2"))
    settings = write_spec(
        tmp_path,
        "name: v5\nversion: '1'\nformat: export\npath: static.pt2\ninput_size: 64\nlayout: yolov5\nlabels: [a, b]\n",
    )
    with pytest.raises(ModelLoadError, match=r"batch of 8 .*static batch size.*Guard failed: x.size\(\)\[0\] == 1"):
        load_model(settings.model, CPU)


class OneBoxHead(torch.nn.Module):
    """A 1x1 convolution then one box per image (yolov8 layout, 2 classes): it has weights, so a dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.conv(x).mean(dim=(2, 3))  # [B, 6]
        box = torch.tensor([32.0, 32.0, 16.0, 16.0, 0.9, 0.1], dtype=x.dtype, device=x.device)
        return (box + features * 0).unsqueeze(2)  # [B, 6, 1]


def test_a_half_precision_model_is_fed_its_own_dtype(tmp_path):
    """An fp16 TorchScript export used to be refused with a message about batch sizes."""
    from contract.frames import unpack_frame
    from gpu_worker.devices import TorchDevice
    from tests.test_gpu_worker_parts import make_frame

    torch.jit.script(OneBoxHead().half()).save(str(tmp_path / "half.pt"))
    settings = write_spec(
        tmp_path,
        "name: half\nversion: '1'\nformat: torchscript\npath: half.pt\n"
        "input_size: 64\nlayout: yolov8\nlabels: [a, b]\n",
    )
    loaded = load_model(settings.model, CPU)
    assert loaded.dtype == torch.float16 and loaded.describe()["precision"] == "fp16"
    device = TorchDevice(loaded, max_batch=2, max_candidates=10)
    frames = [unpack_frame(make_frame(f"j{i}", 64, 48, 0, 8)) for i in range(2)]
    output = device.run(device.stage(frames))
    assert output.errors == {} and output.detections[:, 0].tolist() == [0, 1]


def test_precision_in_the_spec_converts_the_model(tmp_path):
    torch.jit.script(OneBoxHead()).save(str(tmp_path / "full.pt"))
    settings = write_spec(
        tmp_path,
        "name: b\nversion: '1'\nformat: torchscript\npath: full.pt\n"
        "input_size: 64\nlayout: yolov8\nlabels: [a, b]\nprecision: bf16\n",
    )
    assert load_model(settings.model, CPU).dtype == torch.bfloat16


class CpuConstantsInTheGraph(torch.nn.Module):
    """An export whose graph holds a device: torch.arange(...) made on the exporting machine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.arange(x.shape[0], dtype=torch.float32)  # exported as device=cpu
        box = torch.stack(
            [index * 0 + 32, index * 0 + 32, index * 0 + 16, index * 0 + 16, index * 0 + 0.9, index * 0 + 0.1], dim=1
        )
        return box.unsqueeze(2) + x.mean() * 0


def test_an_export_is_checked_at_batch_one_and_the_largest_batch(tmp_path):
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(CpuConstantsInTheGraph(), (torch.zeros(2, 3, 64, 64),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "consts.pt2"))
    settings = write_spec(
        tmp_path,
        "name: c\nversion: '1'\nformat: export\npath: consts.pt2\ninput_size: 64\nlayout: yolov8\nlabels: [a, b]\n",
    )
    loaded = load_model(settings.model, CPU, max_batch=16)
    with torch.inference_mode():
        assert loaded.module(torch.zeros(16, 3, 64, 64)).shape == (16, 6, 1)


@pytest.mark.parametrize(
    "extra, says",
    [
        ("format: torchscript\npath: full.pt\naccelerate: compile\n", "compile takes builtin and export models"),
        ("accelerate: tensorrt\n", "accelerate 'tensorrt': expected none, cuda_graphs, compile"),
    ],
)
def test_an_acceleration_the_model_cannot_take_is_refused_at_load(tmp_path, extra, says):
    torch.jit.script(OneBoxHead()).save(str(tmp_path / "full.pt"))
    with pytest.raises(SettingsError, match=says):
        write_spec(tmp_path, "name: b\nversion: '1'\ninput_size: 64\nlabels: [a, b]\n" + extra)


def test_cuda_graphs_on_the_cpu_is_a_clear_load_error(tmp_path):
    settings = write_spec(tmp_path, "name: b\nversion: '1'\ninput_size: 64\nlabels: [a, b]\naccelerate: cuda_graphs\n")
    with pytest.raises(ModelLoadError, match="cuda_graphs needs a CUDA device, not cpu"):
        load_model(settings.model, CPU)
