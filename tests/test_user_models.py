"""A user serves their own detector by writing one YAML spec: TorchScript or torch.export."""
from __future__ import annotations

import pytest
import torch

from contract.settings import load_settings
from gpu_worker.model import ModelLoadError, load_model
from gpu_worker.postprocess import Geometry, Thresholds, postprocess
from tests.support import build_content_box_model

CPU = torch.device("cpu")


class FixedYolov5(torch.nn.Module):
    """Two boxes per image in the YOLOv5 layout [B, N, 5 + C], whatever the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor([[32.0, 32.0, 20.0, 10.0, 0.9, 0.1, 0.8],
                             [10.0, 50.0, 8.0, 8.0, 0.7, 0.9, 0.1]], device=x.device)
        return rows.expand(x.shape[0], -1, -1) + x.mean() * 0


def write_spec(tmp_path, body: str):
    (tmp_path / "my-model.yaml").write_text(body)
    (tmp_path / "settings.yaml").write_text("model: my-model.yaml\n")
    return load_settings(tmp_path / "settings.yaml")


def test_torchscript_export_served_from_one_yaml_file(tmp_path):
    build_content_box_model(num_classes=2).save(str(tmp_path / "detector.pt"))
    settings = write_spec(tmp_path, "name: mine\nversion: '2'\nformat: torchscript\npath: detector.pt\n"
                                    "input_size: 64\nlayout: yolov8\nlabels: [thing, other]\nconf: 0.5\n")
    loaded = load_model(settings.model, CPU)
    assert settings.model.path == str(tmp_path / "detector.pt")
    assert loaded.describe()["name"] == "mine" and loaded.describe()["labels"] == ["thing", "other"]


def test_torch_export_program_with_a_dynamic_batch(tmp_path):
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(FixedYolov5(), (torch.zeros(2, 3, 64, 64),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "detector.pt2"))
    settings = write_spec(tmp_path, "name: v5\nversion: '1'\nformat: export\npath: detector.pt2\n"
                                    "input_size: 64\nlayout: yolov5\nlabels: [a, b]\n")
    loaded = load_model(settings.model, CPU)
    with torch.inference_mode():
        output = loaded.module(torch.zeros(3, 3, 64, 64))
    geometry = Geometry(*(torch.tensor([v] * 3, dtype=torch.float64) for v in (0, 0, 0.5, 0.5, 128, 128)))
    dets = postprocess(output, "yolov5", Thresholds(torch.full((3,), 0.5), torch.full((3,), 0.5),
                                                    torch.full((3,), 10)), geometry)
    assert dets.class_ids.tolist() == [1, 0] * 3   # 0.9 * 0.8, then 0.7 * 0.9
    assert dets.boxes[0].tolist() == pytest.approx([44.0, 54.0, 84.0, 74.0])


def test_an_export_with_a_static_batch_is_refused_clearly(tmp_path):
    program = torch.export.export(FixedYolov5(), (torch.zeros(1, 3, 64, 64),))
    torch.export.save(program, str(tmp_path / "static.pt2"))
    settings = write_spec(tmp_path, "name: v5\nversion: '1'\nformat: export\npath: static.pt2\n"
                                    "input_size: 64\nlayout: yolov5\nlabels: [a, b]\n")
    with pytest.raises(ModelLoadError, match="batch of 2"):
        load_model(settings.model, CPU)
