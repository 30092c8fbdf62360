"""What a section of the settings is: a frozen dataclass whose values pydantic checks (`settings_class`), and the
error a setting that cannot be used raises (`SettingsError`). contract.settings gathers the sections;
contract.settings.models holds the models' own (a model's spec, the routing), which the settings check against each
other.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass

# Every settings class is a pydantic dataclass: still a frozen dataclass (attribute access,
# dataclasses.replace), and its values are type-checked and coerced where a reading is unambiguous
# ("8" for an int, 8 for a float); unknown keys are refused (the loader names them first).
_SETTINGS_CONFIG = ConfigDict(extra="forbid")


def settings_class(cls: type) -> Any:
    return pydantic_dataclass(frozen=True, config=_SETTINGS_CONFIG)(cls)


class SettingsError(ValueError):
    """A config file or model spec that cannot be used."""
