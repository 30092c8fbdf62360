"""The `scaling` section: how many CPU worker processes a model's backlog and rate want. Part of contract.settings'
`Settings`; what reads the backlog from Redis is contract.workers.scaling, which the settings must not import.
"""

from __future__ import annotations

from contract.settings.sections import SettingsError, settings_class


@settings_class
class ScalingSettings:
    """How many CPU worker processes a model's backlog and rate want (contract.workers.scaling)."""

    target_utilisation: float = 0.7  # each process busy this share of the time: room for bursts within the SLA
    drain_s: float = 0.5  # what waits for a CPU worker is decoded within this long: well inside the 800 ms SLA
    default_cpu_ms: float = 25.0  # the CPU stage an image before any job was answered (then the time bill's)

    def __post_init__(self) -> None:
        if not 0 < self.target_utilisation <= 1 or self.drain_s <= 0 or self.default_cpu_ms <= 0:
            raise SettingsError(
                "scaling.target_utilisation must be in (0, 1], scaling.drain_s and scaling.default_cpu_ms above 0"
            )
