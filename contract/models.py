"""The models a deployment serves, and which one each request gets.

`settings.models` lists every model version; `settings.routing` says which
version `model=name` reaches (a weighted split, or one version), which one a
request without `model=` gets, and which versions are draining (no new jobs,
still served until their lists are empty). Every process builds one
`Catalogue` from the same settings: the API to route, the CPU workers to find
a job's letterbox, the GPU workers to know what they serve.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from contract.settings import ModelSpec, Settings, SettingsError, version_weights


def model_references(settings: Settings) -> list[str]:
    """Every `model=` value a request may give: the names routed somewhere, then each name:version that
    takes jobs, in the order the models are listed."""
    names = [name for name in dict.fromkeys(spec.name for spec in settings.models)
             if version_weights(settings, name)]
    return names + keys_taking_jobs(settings)


def keys_taking_jobs(settings: Settings) -> list[str]:
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
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.specs = {spec.key: spec for spec in settings.models}
        self.draining = frozenset(settings.routing.draining)
        self.default = settings.model
        self._routers = {name: SmoothWeightedRoundRobin(weights)
                         for name in dict.fromkeys(spec.name for spec in settings.models)
                         if (weights := version_weights(settings, name))}

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
            reference = self.settings.default_reference
        name, _, version = reference.partition(":")
        if version:
            spec = self.specs.get(reference)
            if spec is None:
                raise UnknownModel(reference, "no such model version", self.taking_jobs())
            if reference in self.draining:
                raise UnknownModel(reference, "this version is draining (being removed): it takes no new jobs",
                                   self.taking_jobs())
            return spec
        router = self._routers.get(name)
        if router is None:
            reason = ("every version is draining" if any(spec.name == name for spec in self)
                      else "no such model")
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
