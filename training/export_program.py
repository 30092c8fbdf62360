"""The shipped shapes detector as a torch.export program (.pt2) with a dynamic batch, and a spec for it.

    python -m training.export_program OUT_DIR

The default model ships as TorchScript, which `accelerate: compile` cannot take; the same weights as an
exported program can (and so can a user's own `.pt2`). `scripts/gpu-smoke` measures `compile` on it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from contract.settings import REPO_ROOT
from contract.settings.config import load_model_spec
from contract.settings.models import ModelSpec
from gpu_worker.tiny_yolo import TinyYolo

SHAPES_SPEC = REPO_ROOT / "configs" / "models" / "shapes-yolo.yaml"
MAX_BATCH = 64


def export_shapes(out_dir: Path) -> tuple[ModelSpec, Path]:
    """Writes OUT_DIR/shapes-yolo.pt2 and OUT_DIR/shapes-yolo-export.yaml; returns the spec and its file."""
    spec = load_model_spec(str(SHAPES_SPEC), REPO_ROOT)
    module = TinyYolo(len(spec.labels)).eval()
    module.load_state_dict(torch.jit.load(str(spec.path)).state_dict())
    size = spec.input_size
    program = torch.export.export(
        module, (torch.zeros(2, 3, size, size),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},)
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "shapes-yolo.pt2"
    torch.export.save(program, str(weights))
    raw = yaml.safe_load(SHAPES_SPEC.read_text())
    raw.update(format="export", path=weights.name, weights=f"{raw.get('weights', '')}, exported as a program")
    spec_file = out_dir / "shapes-yolo-export.yaml"
    spec_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    return ModelSpec(**{**spec.__dict__, "format": "export", "path": str(weights)}), spec_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    _, spec_file = export_shapes(parser.parse_args(argv).out_dir)
    print(spec_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
