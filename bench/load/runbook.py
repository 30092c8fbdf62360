"""The p95 runbook's steps (docs/operations.md, "p95 is rising: what to decide"), in one place: `bench diagnose`
prints the step its figures point at, and a test checks the page holds each step as `markdown()` renders it, so
the tool's advice and the page cannot drift apart.

Each step names the time-bill stages it answers; the busy ratio picks between the two steps a stage can point at
(frames waiting for a batch with the device idle, or behind a busy device). The story's rule holds throughout:
a bigger batch is never the answer to a CPU-side wait, and past 60% busy the answer is devices, not frames per
batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    number: int
    when: str  # what the figures show (markdown)
    decide: str  # what to do about it (markdown)
    stages: tuple[str, ...] = ()  # the time-bill stages whose lead points here

    def markdown(self) -> str:
        """The step as docs/operations.md lists it."""
        return f"{self.number}. **{self.when}**{self._joint()}{self.decide}"

    def plain(self) -> str:
        """The step as a terminal prints it: the markdown's emphasis and code marks dropped."""
        text = f"runbook step {self.number}: {self.when}{self._joint()}{self.decide}"
        return text.replace("**", "").replace("`", "")

    def _joint(self) -> str:
        return " " if self.when.endswith("?") else ": "


BANDS = (
    (0.20, "under 20%: the bottleneck is outside the GPU (CPU workers starving it, or no traffic); leave GPU settings"),
    (0.60, "20-60%: the pipeline or batching holds the GPU back"),
    (0.90, "60-90%: healthy; the GPU is the limit"),
    (1.01, "over 90%: near saturation; queues and tail latency follow"),
)

STEPS = (
    Step(
        1,
        "Is the load what you think?",
        "`imgserve_api_jobs_submitted_total`'s rate against the rate you planned for. A p95 that rises with no more "
        "load is a change (a deploy, a model version's split, a bigger image mix: `decode` grows with the JPEG's "
        "size, about 10.5 ms per MB here); with no traffic at all, a low busy ratio means nothing.",
    ),
    Step(
        2,
        "`queue_cpu` is the largest stage",
        "the CPU workers cannot keep up. Decide: more CPU workers (`CPU_WORKERS`, `--scale cpu-worker=N`; "
        "[capacity](capacity.md#cores-per-gpu) says how many cores a GPU needs), or refuse earlier "
        "(`backpressure.max_backlog`), never a bigger batch. The device's busy ratio tells which band you are in "
        "(the story's): **under 20%** the bottleneck is outside the GPU (this case, or no traffic); **20-60%** the "
        "pipeline or batching; **60-90%** healthy, the GPU is the limit; **over 90%** queues and tail latency follow.",
        ("queue_cpu",),
    ),
    Step(
        3,
        "`decode` or `resize` itself grew",
        "larger or more expensive images (a tenant's 16-bit PNGs, huge photos). Decide: the decode limits "
        "(`decode.*`), a per-key rate limit for that tenant (`auth.rate_per_s`), or more CPU workers for the same "
        "images; never a bigger batch.",
        ("decode", "resize"),
    ),
    Step(
        4,
        "`backpressure` is above zero",
        "the frame list is full: the GPU side is the limit. With the device over 90% busy: more GPUs (one GPU "
        "worker each), or a faster profile/precision for the model; under that: the GPU worker's host work "
        "(`bench feed` against the device's limit). Raising `backpressure.max_frames` only moves the wait into "
        "the list.",
        ("backpressure",),
    ),
    Step(
        5,
        "`queue_gpu` or `batch_wait` grew with the device idle",
        "batches wait for frames that do not come. Decide: the batching window (`batching.window_ms`) against the "
        "SLA (`bench tune` sweeps it at a load).",
        ("queue_gpu", "batch_wait"),
    ),
    Step(
        6,
        "`device_queue` and `infer` grew, or frames wait behind a busy device",
        "the device is the limit (over 60% busy) or slower (thermal, a shared GPU). Decide: more devices, or "
        "fewer frames per batch if p95 matters more than throughput (the story's batch 16 reached 82% busy and a "
        "p95 of 1.4 s: it was rolled back to 8).",
        ("device_queue", "infer"),
    ),
    Step(
        7,
        "`receive` grew",
        "the API or Redis. Redis's main thread over 70% of a core (`INFO cpu`) is the control plane's ceiling "
        "([capacity](capacity.md#where-one-redis-stops)): bulk shards take the bytes off it; past them, another "
        "deployment.",
        ("receive",),
    ),
    Step(
        8,
        "`postprocess` grew",
        "many candidate boxes an image. Decide: a higher `conf` for the model, or fewer boxes into NMS "
        "(`gpu_worker.max_candidates`).",
        ("postprocess",),
    ),
)

DEVICE_BUSY = 0.60  # from here frames that wait for a batch wait behind the device, not for other frames


def band(busy: float | None) -> str:
    """The story's utilisation band of a busy ratio."""
    if busy is None:
        return "unknown: no GPU busy figure from this deployment"
    return next(text for limit, text in BANDS if busy < limit)


def step_for(stage: str, busy: float | None) -> Step:
    """The runbook's step for a time bill led by `stage`, the device `busy` (0..1, None: unknown)."""
    if stage in ("queue_gpu", "batch_wait") and busy is not None and busy >= DEVICE_BUSY:
        return STEPS[5]
    return next((step for step in STEPS if stage in step.stages), STEPS[0])
