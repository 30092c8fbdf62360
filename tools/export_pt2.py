"""Turn a detector into a torch.export program (.pt2) with a dynamic batch, and write its spec.

    python -m tools.export_pt2 yolov8n.pt --out models/yolov8n.pt2            # Ultralytics, when it imports
    python -m tools.export_pt2 yolo11n.yaml --imgsz 320 --out models/y11.pt2   # from a YAML (random weights)
    python -m tools.export_pt2 gpu_worker.tiny_yolo:build_random --labels a,b --imgsz 320 --out tiny.pt2

Ultralytics has no .pt2 exporter. Its model is prepared here the way its own
TorchScript exporter prepares it: eval, float, fused convolutions, the Detect
head in export mode with a dynamic shape (it then returns the decoded
[B, 4 + C, N] tensor, not a tuple), C2f blocks on their split forward. The
export takes `Dim("batch")`, so one program serves every batch size up to
--max-batch. The program is checked at batch 1 and at --max-batch, then its
spec (labels, input size, layout) is written beside it.

Ultralytics needs torchvision, which does not import beside this project's
torch, so that path is not exercised in CI here; the module:function path is.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

import torch
import yaml


def load_source(source: str, labels: list[str] | None) -> tuple[torch.nn.Module, list[str]]:
    """An Ultralytics weights/YAML file, or `package.module:function` returning an nn.Module."""
    if ":" in source and not Path(source).exists():
        module_name, function = source.split(":", 1)
        if not labels:
            raise SystemExit("--labels is needed with module:function (a plain module does not name its classes)")
        factory = getattr(importlib.import_module(module_name), function)
        try:
            return factory(len(labels)), labels
        except TypeError:
            return factory(), labels
    try:
        from ultralytics import YOLO
    except Exception as exc:  # not installed, or torchvision does not import beside this torch
        raise SystemExit(
            f"{source}: reading an Ultralytics model needs the ultralytics package, which does not "
            f"import here ({type(exc).__name__}: {exc}); export from a venv where it does"
        ) from exc
    model = YOLO(source).model
    names = model.names
    found = [names[i] for i in sorted(names)] if isinstance(names, dict) else list(names)
    return _prepared_like_ultralytics(model), labels or found


def _prepared_like_ultralytics(model: torch.nn.Module) -> torch.nn.Module:
    model = model.float().eval()
    for parameter in model.parameters():
        parameter.requires_grad = False
    if hasattr(model, "fuse"):
        model = getattr(model, "fuse")()  # noqa: B009  (getattr: nn.Module types its attributes as Tensor)
    for part in model.modules():
        if hasattr(part, "export") and hasattr(part, "dynamic"):  # Detect and its subclasses
            for name, value in (("export", True), ("dynamic", True), ("format", "torchscript")):
                setattr(part, name, value)
        elif hasattr(part, "forward_split"):  # C2f
            setattr(part, "forward", getattr(part, "forward_split"))  # noqa: B009, B010  (likewise)
    return model


def export(model: torch.nn.Module, imgsz: int, max_batch: int, out: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=max(2, max_batch))
    sample = torch.zeros(2, 3, imgsz, imgsz)
    with torch.no_grad():
        program = torch.export.export(model.eval(), (sample,), dynamic_shapes=({0: batch},))
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(out))


def check(out: Path, imgsz: int, max_batch: int, classes: int) -> str:
    """The saved program at batch 1 and max_batch: its layout, from where the 4 + C values lie."""
    module = torch.export.load(str(out)).module()
    layout = ""
    for size in sorted({1, max_batch}):
        with torch.no_grad():
            output = module(torch.zeros(size, 3, imgsz, imgsz))
        if not isinstance(output, torch.Tensor) or output.dim() != 3 or output.shape[0] != size:
            raise SystemExit(
                f"the program's output at batch {size} is not a [B, ., .] tensor: "
                f"{getattr(output, 'shape', type(output).__name__)}"
            )
        layout = "yolov8" if output.shape[1] == 4 + classes else "yolov5" if output.shape[2] == 5 + classes else ""
        if not layout:
            raise SystemExit(f"output {tuple(output.shape)} fits neither [B, 4+{classes}, N] nor [B, N, 5+{classes}]")
    return layout


def write_spec(out: Path, name: str, imgsz: int, labels: list[str], layout: str) -> Path:
    spec: dict[str, Any] = {
        "name": name,
        "version": "1",
        "format": "export",
        "path": out.name,
        "input_size": imgsz,
        "layout": layout,
        "labels": labels,
    }
    spec_path = out.with_suffix(".yaml")
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.export_pt2", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="Ultralytics .pt / .yaml, or package.module:function")
    parser.add_argument("--out", type=Path, required=True, help="the .pt2 to write (its spec goes beside it)")
    parser.add_argument("--imgsz", type=int, default=640, help="square input size")
    parser.add_argument("--max-batch", type=int, default=64, help="largest batch the program accepts")
    parser.add_argument(
        "--labels",
        type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
        help="comma-separated class names (read from an Ultralytics model otherwise)",
    )
    parser.add_argument("--name", help="the model's name in the spec (default: the output's stem)")
    args = parser.parse_args(argv)
    model, labels = load_source(args.source, args.labels)
    export(model, args.imgsz, args.max_batch, args.out)
    layout = check(args.out, args.imgsz, args.max_batch, len(labels))
    spec_path = write_spec(args.out, args.name or args.out.stem, args.imgsz, labels, layout)
    print(f"wrote {args.out} ({layout}, batch 1..{args.max_batch}, {args.imgsz}x{args.imgsz}) and its spec {spec_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
