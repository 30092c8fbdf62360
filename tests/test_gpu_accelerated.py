"""torch.compile and CUDA graphs against the eager forward. On the CPU, `make test` compiles with
`aot_eager`: Dynamo's trace of the model with its dynamic batch, its guards and recompiles across batch sizes,
and AOTAutograd, in seconds. The same case with Inductor's C++ code generation takes ~100 s of CPU (30-200 s of
a 2-core machine's wall time, half of it beside the rest of the suite), so it is marked `inductor` and runs when
asked (`scripts/test tests/test_gpu_accelerated.py`, `make test-inductor`); scripts/gpu-smoke runs the CUDA
cases, Inductor's among them."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from contract.settings.models import ModelSpec
from tests.test_gpu import device_for, needs_cuda, run_overlapped, scene_frames
from training.export_program import export_shapes

ACCELERATED = [
    pytest.param("cuda", "cuda_graphs", None, marks=needs_cuda),
    pytest.param("cuda", "compile", None, marks=needs_cuda),
    pytest.param("cpu", "compile", "aot_eager"),
    pytest.param("cpu", "compile", None, marks=[pytest.mark.slow, pytest.mark.inductor]),
]  # None: torch.compile's own backend (Inductor)


@pytest.mark.parametrize("device, accelerate, backend", ACCELERATED)
def test_an_accelerated_forward_gives_the_eager_answers(device, accelerate, backend, tmp_path, monkeypatch):
    """Batches whose size changes each time (a CUDA graph's static output is overwritten by the next
    replay of its size), staged in one thread while the device runs in another."""
    if backend is not None:  # the product calls torch.compile(module, dynamic=True): the backend is the test's
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
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
