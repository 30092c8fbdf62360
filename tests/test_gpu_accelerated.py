"""torch.compile and CUDA graphs against the eager forward (the CPU compile case alone takes ~30-80 s: its own
file, so that the suite's two pytest processes run it beside the rest; scripts/gpu-smoke runs the CUDA cases)."""

from __future__ import annotations

import numpy as np
import pytest

from contract.settings.models import ModelSpec
from tests.test_gpu import device_for, needs_cuda, run_overlapped, scene_frames
from training.export_program import export_shapes

ACCELERATED = [
    pytest.param("cuda", "cuda_graphs", marks=needs_cuda),
    pytest.param("cuda", "compile", marks=needs_cuda),
    pytest.param("cpu", "compile", marks=pytest.mark.slow),
]  # torch.compile on this CPU: ~60 s


@pytest.mark.parametrize("device, accelerate", ACCELERATED)
def test_an_accelerated_forward_gives_the_eager_answers(device, accelerate, tmp_path):
    """Batches whose size changes each time (a CUDA graph's static output is overwritten by the next
    replay of its size), staged in one thread while the device runs in another."""
    sizes = [8, 1, 3, 8, 2, 1, 5, 8]
    batches = [scene_frames(size, seed=i) for i, size in enumerate(sizes)]
    spec, _ = export_shapes(tmp_path)
    eager = device_for(device, spec)
    expected = [eager.run(eager.stage(frames)).detections for frames in batches]
    fast = device_for(device, ModelSpec(**{**spec.__dict__, "accelerate": accelerate}))
    assert len(list(fast.warm_up(8))) == 16
    found = run_overlapped(fast, batches)
    assert [len(rows) for rows in found] == [len(rows) for rows in expected]
    assert sum(len(rows) for rows in found) > 0
    for one, other in zip(expected, found):
        assert np.array_equal(one[:, [0, 6]], other[:, [0, 6]])  # image, class
        assert np.allclose(one[:, 1:6], other[:, 1:6], atol=1e-2)  # boxes, scores
