"""The sample images in samples/: shapes scenes whose boxes are known, made from a seed.

    python -m training.samples [--out samples] [--seeds 3,36]

Each scene is drawn by training.synth's original generator (palette colours on busy backgrounds; the
default model scores mAP@0.5 0.951 on its held-out scenes) at 1280x720, saved as JPEG (quality 90), and
its true boxes go to `<name>.truth.json` beside it: {"width", "height", "objects": [{"label", "box"}]},
boxes in pixels (x1, y1, x2, y2). The seeds shipped are the ones samples/README.md names.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from training.synth import LABELS, generate_scene

SIZE = (1280, 720)
SEEDS = (3, 36)
QUALITY = 90


def write_sample(seed: int, out: Path) -> Path:
    scene = generate_scene(random.Random(seed), size=SIZE)
    image_path = out / f"shapes-{seed}.jpg"
    scene.image.convert("RGB").save(image_path, "JPEG", quality=QUALITY)
    truth = {
        "width": SIZE[0],
        "height": SIZE[1],
        "objects": [
            {"label": LABELS[class_id], "box": [round(v, 1) for v in box]}
            for class_id, box in zip(scene.classes, scene.boxes)
        ],
    }
    (out / f"shapes-{seed}.truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    return image_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.samples", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "samples")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        print(write_sample(seed, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
