"""The models a deployment serves, and which one each request gets.

A `ModelSpec` is one model version: what the GPU worker loads and what the CPU workers letterbox for.
`settings.models` lists every version; `settings.routing` (`RoutingSettings`) says which version `model=name`
reaches (a weighted split, or one version), which one a request without `model=` gets, and which versions are
draining (no new jobs, still served until their lists are empty). The settings check the two against each other
when they are built (`default_model`). Every process builds one `Catalogue` from the same settings: the API to
route, the CPU workers to find a job's letterbox, the GPU workers to know what they serve.
"""

from __future__ import annotations

import datetime
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import field
from typing import Any, Protocol

from contract.settings.sections import SettingsError, settings_class


@settings_class
class RoutingSettings:
    """Which model a request gets. `model=name:version` pins a version; `model=name` follows `routes`; no
    `model` at all gets `default`."""

    default: str = ""  # a name or name:version; "": the first model listed
    # model=name -> {version: weight, ...} (a split, e.g. {2.0.0: 90, 3.0.0: 10}) or one version (pinned).
    # A name without a route: its first version listed (a version added later takes no traffic until routed).
    routes: dict[str, Any] = field(default_factory=dict)
    draining: tuple[str, ...] = ()  # name:version: no new jobs; still served until its lists are empty


# A model's name and version appear in Redis keys (name:version) and in `model=`: no colons, no spaces.
MODEL_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}"
# How the GPU worker may speed a model's forward up beyond eager PyTorch (ModelSpec.accelerate).
ACCELERATIONS = ("none", "cuda_graphs", "compile")


@settings_class
class ModelSpec:
    """What the GPU worker loads and what the CPU workers letterbox for."""

    name: str
    version: str
    format: str = "builtin"  # builtin | torchscript | export (a torch.export .pt2 file)
    builtin: str = "tiny_yolo"
    path: str | None = None
    weights: str = "random"
    input_size: int = 640
    channel_order: str = "rgb"
    pad_value: int = 114
    scale: float = 1.0 / 255.0
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    layout: str = "yolov8"  # yolov8: [B, 4+C, N]; yolov5: [B, N, 5+C]
    precision: str = "auto"  # auto: the model's own weights' dtype | fp32 | fp16 | bf16
    channels_last: bool = False  # NHWC canvas and weights: faster convolutions on tensor cores
    freeze: bool = False  # TorchScript only: torch.jit.freeze + optimize_for_inference at load
    # none | cuda_graphs (one CUDA graph per batch size, captured at load; CUDA only) | compile (torch.compile
    # with a dynamic batch, compiled at load; builtin and export models: TorchScript has `freeze`)
    accelerate: str = "none"
    labels: tuple[str, ...] = ()
    # Which of labels / input_size were read from the model file (the spec left them out).
    from_file: tuple[str, ...] = ()
    conf: float = 0.25
    iou: float = 0.45
    max_det: int = 100
    # Per-model limits; unset: the deployment's (backpressure.max_frames / max_backlog,
    # jobs.default_deadline_ms). One model's overload refuses only its own requests.
    max_frames: int | None = None
    max_backlog: int | None = None
    max_waiting_bytes: int | None = None
    default_deadline_ms: int | None = None
    # Device `sim`: this model's batch latency by batch size (models differ in cost); unset: gpu_worker's.
    sim_latency_ms: dict[int, float] | None = None
    cache: bool | None = None  # the result cache for this model; unset: the deployment's cache.enabled

    @property
    def key(self) -> str:
        """name:version, as requests pin it and Redis keys carry it."""
        return f"{self.name}:{self.version}"

    def __post_init__(self) -> None:
        for what, value in (("name", self.name), ("version", self.version)):
            if not re.fullmatch(MODEL_NAME_PATTERN, value):
                raise SettingsError(
                    f"model {what} {value!r}: letters, digits and . _ + - only (at most 64), "
                    "starting with a letter or digit"
                )
        for limit in ("max_frames", "max_backlog", "max_waiting_bytes", "default_deadline_ms"):
            if getattr(self, limit) is not None and getattr(self, limit) < 1:
                raise SettingsError(f"model {self.key}: {limit} must be >= 1")
        if self.format not in ("builtin", "torchscript", "export"):
            raise SettingsError(f"model format {self.format!r}: expected builtin, torchscript or export")
        if self.format != "builtin" and not self.path:
            raise SettingsError(f"a {self.format} model needs a path")
        if self.layout not in ("yolov8", "yolov5"):
            raise SettingsError(f"model layout {self.layout!r}: expected yolov8 or yolov5")
        if self.freeze and self.format != "torchscript":
            raise SettingsError("freeze applies to TorchScript models only")
        if self.accelerate not in ACCELERATIONS:
            raise SettingsError(f"accelerate {self.accelerate!r}: expected {', '.join(ACCELERATIONS)}")
        if self.accelerate == "compile" and self.format == "torchscript":
            raise SettingsError("accelerate: compile takes builtin and export models; for TorchScript use freeze")
        if self.precision not in ("auto", "fp32", "fp16", "bf16"):
            raise SettingsError(f"precision {self.precision!r}: expected auto, fp32, fp16 or bf16")
        if self.channel_order not in ("rgb", "bgr"):
            raise SettingsError(f"channel_order {self.channel_order!r}: expected rgb or bgr")
        if not self.labels:
            raise SettingsError("a model needs its labels")
        if not 8 <= self.input_size <= 4096:
            raise SettingsError(f"input_size {self.input_size} out of range")

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "weights": self.weights,
            "labels": list(self.labels),
            "input_size": self.input_size,
            "layout": self.layout,
            **({"from_file": list(self.from_file)} if self.from_file else {}),
            "defaults": {"conf": self.conf, "iou": self.iou, "max_det": self.max_det},
        }


class Deployment(Protocol):
    """What routing reads of the settings (contract.settings.Settings is one)."""

    @property
    def models(self) -> tuple[ModelSpec, ...]: ...

    @property
    def routing(self) -> RoutingSettings: ...

    @property
    def model(self) -> ModelSpec: ...


def version_text(version: Any) -> Any:
    """A spec's version as text. YAML reads `version: 2024-05-01` as a date (kept: its text is the same) and
    `version: 1.10` as the number 1.1 (refused: the text written is gone; quote it)."""
    if isinstance(version, (datetime.date, datetime.datetime)):
        return version.isoformat()
    if isinstance(version, (int, float)) and not isinstance(version, bool):
        raise SettingsError(
            f"a model spec's version: YAML read it as the number {version!r}; write it in quotes "
            f'(version: "{version}" is what YAML kept of it)'
        )
    return version


def default_reference(settings: Deployment) -> str:
    """What a request without `model=` asks for: `routing.default`, else the first model's name."""
    return settings.routing.default or settings.models[0].name


def version_weights(settings: Deployment, name: str) -> dict[str, float]:
    """How `model=name` is split over its versions: {version: weight}, weights > 0, draining ones left out.
    Without a route: its first version listed that is not draining. Empty: nothing of that name takes jobs."""
    draining = set(settings.routing.draining)
    versions = [spec.version for spec in settings.models if spec.name == name]
    route = settings.routing.routes.get(name)
    if route is None:
        live = [version for version in versions if f"{name}:{version}" not in draining]
        return {live[0]: 1.0} if live else {}
    weights = {str(route): 1.0} if not isinstance(route, dict) else {str(v): float(w) for v, w in route.items()}
    return {
        version: weight for version, weight in weights.items() if weight > 0 and f"{name}:{version}" not in draining
    }


def default_model(settings: Deployment, served: Sequence[str] = ()) -> ModelSpec:
    """Check `models`, `routing` and the models GPU workers are told to serve (`served`: gpu_worker.models)
    against each other; the spec a request without `model=` gets (for a split default: its heaviest version)."""
    by_key = _checked_routing(settings, served)
    ref = default_reference(settings)
    if ":" in ref:
        if ref not in by_key or ref in settings.routing.draining:
            raise SettingsError(f"routing.default: {ref!r} is not a listed model version taking jobs")
        return by_key[ref]
    weights = version_weights(settings, ref) if ref in {spec.name for spec in settings.models} else {}
    if not weights:
        raise SettingsError(f"routing.default: no version of {ref!r} takes jobs")
    return by_key[f"{ref}:{max(weights, key=lambda version: weights[version])}"]


def _checked_routing(settings: Deployment, served: Sequence[str]) -> dict[str, ModelSpec]:
    """The models by name:version, once each; every route, draining version and served model names one."""
    by_key: dict[str, ModelSpec] = {}
    for spec in settings.models:
        if spec.key in by_key:
            raise SettingsError(f"model {spec.key} is listed twice")
        by_key[spec.key] = spec
    names = {spec.name for spec in settings.models}
    for key in settings.routing.draining:
        if key not in by_key:
            raise SettingsError(f"routing.draining: {key!r} is not a name:version listed in models")
    for name, route in settings.routing.routes.items():
        if name not in names:
            raise SettingsError(f"routing.routes: no model named {name!r}")
        weights = route if isinstance(route, dict) else {route: 1}
        for version, weight in weights.items():
            if f"{name}:{version}" not in by_key:
                raise SettingsError(f"routing.routes.{name}: no version {version!r} of {name} is listed")
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
                raise SettingsError(f"routing.routes.{name}.{version}: a weight >= 0, got {weight!r}")
        if not version_weights(settings, name):
            raise SettingsError(f"routing.routes.{name}: no version with a weight above 0 that is not draining")
    for ref in served:
        if ref not in by_key and ref not in names:
            raise SettingsError(f"gpu_worker.models: {ref!r} is neither a model name nor a name:version listed")
    return by_key


def model_references(settings: Deployment) -> list[str]:
    """Every `model=` value a request may give: the names routed somewhere, then each name:version that
    takes jobs, in the order the models are listed."""
    names = [name for name in dict.fromkeys(spec.name for spec in settings.models) if version_weights(settings, name)]
    return names + keys_taking_jobs(settings)


def keys_taking_jobs(settings: Deployment) -> list[str]:
    """name:version of every model a request may reach (all but the draining ones), as listed."""
    draining = set(settings.routing.draining)
    return [spec.key for spec in settings.models if spec.key not in draining]


class UnknownModel(LookupError):
    """A `model=` that names nothing this deployment takes jobs for."""

    def __init__(self, reference: str, reason: str, served: list[str]) -> None:
        super().__init__(f"model {reference!r}: {reason}")
        self.reference = reference
        self.reason = reason
        self.served = served


class SmoothWeightedRoundRobin:
    """nginx's smooth weighted round robin: over any run of sum(weights) picks each choice comes up
    exactly its weight's share of times, spread out (90/10 gives A nine times, then B, ...), so a split
    holds over a handful of requests, not only on average. Per process; thread-safe."""

    def __init__(self, weights: dict[str, float]) -> None:
        if not weights or any(weight <= 0 for weight in weights.values()):
            raise ValueError(f"weights must be > 0, got {weights}")
        self.weights = dict(weights)
        self.total = sum(weights.values())
        self.current = {choice: 0.0 for choice in weights}
        self.lock = threading.Lock()

    def pick(self) -> str:
        with self.lock:
            for choice, weight in self.weights.items():
                self.current[choice] += weight
            chosen = max(self.current, key=lambda choice: self.current[choice])
            self.current[chosen] -= self.total
            return chosen


class Catalogue:
    def __init__(self, settings: Deployment) -> None:
        self.settings = settings
        self.specs = {spec.key: spec for spec in settings.models}
        self.draining = frozenset(settings.routing.draining)
        self.default = settings.model
        self._routers = {
            name: SmoothWeightedRoundRobin(weights)
            for name in dict.fromkeys(spec.name for spec in settings.models)
            if (weights := version_weights(settings, name))
        }

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(self.specs.values())

    def get(self, key: str) -> ModelSpec | None:
        return self.specs.get(key)

    def taking_jobs(self) -> list[str]:
        """name:version of every model a request may reach."""
        return keys_taking_jobs(self.settings)

    def weights(self, name: str) -> dict[str, float]:
        return version_weights(self.settings, name)

    def resolve(self, reference: str | None) -> ModelSpec:
        """The model a request with `model=reference` gets (None or "": the default, as configured)."""
        if not reference:
            reference = default_reference(self.settings)
        name, _, version = reference.partition(":")
        if version:
            spec = self.specs.get(reference)
            if spec is None:
                raise UnknownModel(reference, "no such model version", self.taking_jobs())
            if reference in self.draining:
                raise UnknownModel(
                    reference, "this version is draining (being removed): it takes no new jobs", self.taking_jobs()
                )
            return spec
        router = self._routers.get(name)
        if router is None:
            reason = "every version is draining" if any(spec.name == name for spec in self) else "no such model"
            raise UnknownModel(reference, reason, self.taking_jobs())
        return self.specs[f"{name}:{router.pick()}"]

    def select(self, references: Iterable[str]) -> list[ModelSpec]:
        """The specs `references` name ("name": each version; "name:version"); none: every model."""
        references = list(references)
        if not references:
            return list(self)
        chosen: list[ModelSpec] = []
        for reference in references:
            found = [spec for spec in self if reference in (spec.key, spec.name)]
            if not found:
                raise SettingsError(f"model {reference!r} is not configured (models: {', '.join(self.specs)})")
            chosen += [spec for spec in found if spec not in chosen]
        return chosen
