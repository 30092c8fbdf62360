"""How the settings are read: the default file, the file laid over it, then the environment.

`configs/default.yaml` holds the defaults; the file named by `IMGSERVE_CONFIG` (or passed to
`load_settings`) is laid over it; then the environment: `IMGSERVE_REDIS_URL`, `IMGSERVE_CALLBACK_SECRET`,
and `IMGSERVE_<SECTION>__<KEY>` for any other setting. What the settings are is contract.settings.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import ValidationError

from contract.settings import (
    REPO_ROOT,
    ApiSettings,
    AuthSettings,
    BackpressureSettings,
    BatchingSettings,
    CacheSettings,
    CallbackSettings,
    CeleryWorkerSettings,
    DecodeSettings,
    GpuWorkerSettings,
    JobSettings,
    LogSettings,
    Settings,
    model_files,
)
from contract.settings.cells import CELLS_ENV, cell_passwords, cells_from_env
from contract.settings.check_secrets import check_secret
from contract.settings.models import ModelSpec, RoutingSettings, version_text
from contract.settings.redis_settings import BulkSettings, RedisSettings, renamed_settings
from contract.settings.scaling import ScalingSettings
from contract.settings.sections import SettingsError

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"
CONFIG_ENV = "IMGSERVE_CONFIG"
REDIS_URL_ENV = "IMGSERVE_REDIS_URL"

# Any setting from the environment: IMGSERVE_<SECTION>__<KEY>=value (the double underscore separates the
# section from the key; the value is read as YAML: 20, 0.5, true, [a, b]), e.g. IMGSERVE_GPU_WORKER__DEVICE=sim,
# IMGSERVE_BATCHING__WINDOW_MS=8. Top-level keys keep their own variables (IMGSERVE_REDIS_URL).
ENV_PREFIX, ENV_SEPARATOR = "IMGSERVE_", "__"

# 0.1.0's names for variables that now follow that rule: refused, naming the new one (read as nothing, the API
# would bind or log otherwise than its operator asked, without a word). CHANGELOG: Upgrading from 0.1.0.
RENAMED_ENV = {
    "IMGSERVE_API_BIND": "IMGSERVE_API__BIND",
    "IMGSERVE_API_WORKERS": "IMGSERVE_API__WORKERS",
    "IMGSERVE_API_WORKER_CLASS": "IMGSERVE_API__WORKER_CLASS",
    "IMGSERVE_API_CONNECTIONS": "IMGSERVE_API__CONNECTIONS",
    "IMGSERVE_API_THREADS": "IMGSERVE_API__THREADS",
    "IMGSERVE_ACCESS_LOG": "IMGSERVE_API__ACCESS_LOG",
    "IMGSERVE_METRICS_PORT": "IMGSERVE_API__METRICS_PORT",
    "IMGSERVE_LOG_FORMAT": "IMGSERVE_LOGS__FORMAT",
    "IMGSERVE_LOG_LEVEL": "IMGSERVE_LOGS__LEVEL",
}

JOB_ID_SECRET_ENV = "IMGSERVE_JOB_ID_SECRET"


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Defaults, then the named (or `IMGSERVE_CONFIG`) file, then the environment: IMGSERVE_REDIS_URL,
    IMGSERVE_CALLBACK_SECRET, IMGSERVE_JOB_ID_SECRET, and IMGSERVE_<SECTION>__<KEY> for any other setting
    (RENAMED_ENV's old names refused)."""
    raw = _read_config(DEFAULT_CONFIG)
    overlay_path = path or os.environ.get(CONFIG_ENV)
    if overlay_path:
        overlay = _read_config(Path(overlay_path))
        if "models" in overlay and "model" in overlay:
            raise SettingsError(f"config {overlay_path}: give `models:` (several) or `model:` (one), not both")
        if "model" in overlay:  # one model named the old way replaces the default list
            raw.pop("models", None)
        raw = _merge(raw, overlay)
    if os.environ.get(REDIS_URL_ENV):
        raw["redis_url"] = os.environ[REDIS_URL_ENV]
    if os.environ.get("IMGSERVE_CALLBACK_SECRET"):
        raw["callbacks"] = {**raw.get("callbacks", {}), "secret": os.environ["IMGSERVE_CALLBACK_SECRET"]}
    if os.environ.get(JOB_ID_SECRET_ENV):  # as it is: a secret of digits read as YAML would be a number
        raw["jobs"] = {**raw.get("jobs", {}), "id_secret": os.environ[JOB_ID_SECRET_ENV]}
    if os.environ.get(CELLS_ENV, "").strip():
        raw["cells"] = cells_from_env(os.environ[CELLS_ENV])
    raw = _merge(raw, environment_overrides(os.environ))
    entries, single = raw.pop("models", None), raw.pop("model", None)
    raw["models"] = load_model_specs(entries, REPO_ROOT) if entries else (load_model_spec(single, REPO_ROOT),)
    raw["model"] = raw["models"][0]  # replaced by the routed default once routing is read
    settings: Settings = _build(Settings, raw)
    _check_secrets(settings)
    for problem in key_share_problems(settings):
        warnings.warn(problem, UserWarning, stacklevel=2)
    return settings


def key_share_problems(settings: Settings) -> list[str]:
    """Models whose backlog one API key can fill alone: its share (auth.max_backlog_share of max_backlog, in its
    own CPU queue) and the frame list it can fill behind it (max_frames) reach max_backlog, so another key's
    jobs are refused while it floods, which the share is there to prevent; the same for its share of the byte
    budget (its uploads) and the frame list's bytes. Only with API keys configured."""
    if not settings.auth.api_keys:
        return []
    problems = []
    for spec in settings.models:
        limit = settings.max_backlog(spec)
        share = max(1, int(limit * settings.auth.max_backlog_share))
        if share + settings.max_frames(spec) >= limit:
            problems.append(
                f"model {spec.key}: one API key's share of the backlog ({share}) and the frame list "
                f"({settings.max_frames(spec)}) reach max_backlog ({limit}): a key's flood can refuse "
                "every other key's jobs; raise max_backlog or lower auth.max_backlog_share or max_frames"
            )
        budget, frames = settings.max_waiting_bytes(spec), settings.max_frames(spec) * spec.input_size**2 * 3
        if int(budget * settings.auth.max_waiting_bytes_share) + frames >= budget:  # the same for bytes
            problems.append(
                f"model {spec.key}: one API key's share of the byte budget and the frame list's largest frames "
                f"({frames} bytes) reach max_waiting_bytes ({budget}): a key's uploads can refuse every other key's "
                "jobs; raise max_waiting_bytes or lower auth.max_waiting_bytes_share or max_frames"
            )
    return problems


def load_model_specs(entries: Any, base_dir: Path) -> tuple[ModelSpec, ...]:
    """`models:` as a list of entries (a spec file path, an inline spec, or {spec: path, <overrides>}) or a
    folder whose *.yaml files are specs, in name order."""
    if isinstance(entries, (str, os.PathLike)):
        folder = _resolve(entries, base_dir)
        if not folder.is_dir():
            raise SettingsError(f"models: {folder} is not a folder of spec files (or give a list)")
        entries = [str(path) for path in sorted(folder.glob("*.yaml"))]
        if not entries:
            raise SettingsError(f"models: no *.yaml spec in {folder}")
    if not isinstance(entries, (list, tuple)) or not entries:
        raise SettingsError("models: a non-empty list of specs, or a folder of spec files")
    return tuple(load_model_spec(entry, base_dir) for entry in entries)


def _check_secrets(settings: Settings) -> None:
    if settings.callbacks.secret:
        check_secret("the callback secret (callbacks.secret / IMGSERVE_CALLBACK_SECRET)", settings.callbacks.secret)
    if settings.jobs.id_secret:
        check_secret("the job id secret (jobs.id_secret / IMGSERVE_JOB_ID_SECRET)", settings.jobs.id_secret)
    password = urlsplit(settings.redis_url).password
    if password:
        check_secret("the Redis password in redis_url / IMGSERVE_REDIS_URL", unquote(password))
    if settings.redis.sentinel_password:
        check_secret(
            "the Sentinels' password (redis.sentinel_password / IMGSERVE_REDIS__SENTINEL_PASSWORD)",
            settings.redis.sentinel_password,
        )
    for index, url in enumerate(settings.bulk.redis_urls):
        password = urlsplit(url).password
        if password:
            check_secret(f"the Redis password in bulk.redis_urls[{index}]", unquote(password))
    password = urlsplit(settings.cache.redis_url).password
    if password:
        check_secret("the Redis password in cache.redis_url / IMGSERVE_CACHE__REDIS_URL", unquote(password))
    for where, password in cell_passwords(settings.cells):
        check_secret(f"the Redis password in {where}", password)


def load_model_spec(value: Any, base_dir: Path) -> ModelSpec:
    """A model spec inline (a mapping) or in its own YAML file (a path).

    Relative paths resolve against the file that names them, then the repo.
    """
    if isinstance(value, dict) and "spec" in value:  # a spec file with this deployment's overrides
        overrides = {key: item for key, item in value.items() if key != "spec"}
        spec_path = _resolve(value["spec"], base_dir)
        raw = {**_read_yaml(spec_path), **overrides}
        if "path" not in overrides:
            base_dir = spec_path.parent
    elif isinstance(value, (str, os.PathLike)):
        spec_path = _resolve(value, base_dir)
        raw = _read_yaml(spec_path)
        base_dir = spec_path.parent
    elif isinstance(value, dict):
        raw = dict(value)
    else:
        raise SettingsError("settings need a model: a spec file path or a mapping")
    if raw.get("path"):
        raw["path"] = str(_resolve(raw["path"], base_dir))
    raw["version"] = version_text(raw.get("version"))
    for key in ("mean", "std", "labels"):
        if key in raw:
            raw[key] = tuple(raw[key])
    _fill_from_model_file(raw)
    spec: ModelSpec = _build(ModelSpec, raw)
    return spec


def log_settings_from(environ: Mapping[str, str]) -> LogSettings:
    """The `logs` settings from the environment alone: for a process's first lines, before its settings
    are read."""
    try:
        section = environment_overrides(environ).get("logs", {})
        values = {key: value if isinstance(value, bool) else str(value) for key, value in section.items()}
        return _build(LogSettings, values)  # type: ignore[no-any-return]
    except SettingsError:
        return _build(LogSettings, {})  # type: ignore[no-any-return]   # load_settings says what is wrong


def environment_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """IMGSERVE_<SECTION>__<KEY>=value as {section: {key: value}}; an unknown section or key is refused
    when the settings are built, like an unknown key in a file, and a variable of RENAMED_ENV at once."""
    overrides: dict[str, Any] = {}
    for name, text in environ.items():
        if name in RENAMED_ENV:
            raise SettingsError(f"{name} is 0.1.0's name, no longer read: set {RENAMED_ENV[name]}")
        if not name.startswith(ENV_PREFIX) or ENV_SEPARATOR not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition(ENV_SEPARATOR)
        if not section or not key or ENV_SEPARATOR in key:
            raise SettingsError(f"{name}: expected {ENV_PREFIX}<SECTION>{ENV_SEPARATOR}<KEY>")
        if _nested_type(Settings, section) is None:
            raise SettingsError(f"{name}: no settings section {section!r} (the model is set in its spec file)")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise SettingsError(f"{name}: not a YAML value: {exc}") from exc
        overrides.setdefault(section, {})[key] = value
    return renamed_settings(overrides, "the environment")


def _fill_from_model_file(raw: dict[str, Any]) -> None:
    """labels / input_size a TorchScript file carries (Ultralytics, YOLOv5), where the spec leaves them out."""
    missing = [key for key in ("labels", "input_size") if key not in raw]
    path = Path(raw.get("path") or "")
    if raw.get("format") != "torchscript" or not missing or not path.is_file():
        return
    try:
        found = model_files.embedded_metadata(path)
    except model_files.ModelFileError as exc:
        raise SettingsError(f"model file {path}: {exc}") from exc
    taken = [key for key in missing if key in found]
    raw.update({key: found[key] for key in taken})
    if taken:
        raw["from_file"] = tuple(taken)


def _read_config(path: Path) -> dict[str, Any]:
    """A settings file, its model references made absolute against its own folder."""
    raw = _read_yaml(path)
    folder = path.resolve().parent
    if "model" in raw:
        raw["model"] = _absolute_model_ref(raw["model"], folder)
    models = raw.get("models")
    if isinstance(models, str):
        raw["models"] = str(_resolve(models, folder))
    elif isinstance(models, list):
        raw["models"] = [_absolute_model_ref(entry, folder) for entry in models]
    return renamed_settings(raw, str(path))


def _absolute_model_ref(entry: Any, folder: Path) -> Any:
    if isinstance(entry, str):
        return str(_resolve(entry, folder))
    if isinstance(entry, dict):
        entry = dict(entry)
        for key in ("spec", "path"):
            if isinstance(entry.get(key), str):
                entry[key] = str(_resolve(entry[key], folder))
    return entry


def _resolve(value: str | os.PathLike[str], base_dir: Path) -> Path:
    candidate = Path(value)
    if candidate.is_absolute():
        return candidate
    for root in (base_dir, REPO_ROOT):
        if (root / candidate).exists():
            return (root / candidate).resolve()
    return (base_dir / candidate).resolve()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config {path} must be a mapping")
    return data


def _merge(base: dict[str, Any], overlay: dict[str, Any], sections: bool = True) -> dict[str, Any]:
    """`overlay` over `base`, section by section, setting by setting. A setting whose value is itself a mapping
    (`gpu_worker.sim_latency_ms`: a table by batch size) is replaced whole: merged key by key, a profile that
    names some batch sizes would keep the default's entries for the others."""
    merged = dict(base)
    for key, value in overlay.items():
        if sections and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value, sections=False)
        else:
            merged[key] = value
    return merged


def _build(cls: type, raw: dict[str, Any]) -> Any:
    """Build a dataclass from a mapping, refusing keys it does not know."""
    if not isinstance(raw, dict):
        return raw
    known = {f.name: f for f in fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise SettingsError(f"unknown {cls.__name__} settings: {', '.join(sorted(unknown))}")
    values = {}
    for name, value in raw.items():
        nested = _nested_type(cls, name)
        values[name] = _build(nested, value) if nested and isinstance(value, dict) else value
    try:
        return cls(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: ".lstrip(": ") + error["msg"].removeprefix("Value error, ")
            for error in exc.errors()
        )
        raise SettingsError(f"{cls.__name__}: {problems}") from None
    except TypeError as exc:
        raise SettingsError(f"{cls.__name__}: {exc}") from exc


def _nested_type(cls: type, name: str) -> type | None:
    nested = {
        "api": ApiSettings,
        "logs": LogSettings,
        "decode": DecodeSettings,
        "jobs": JobSettings,
        "batching": BatchingSettings,
        "gpu_worker": GpuWorkerSettings,
        "celery": CeleryWorkerSettings,
        "backpressure": BackpressureSettings,
        "auth": AuthSettings,
        "callbacks": CallbackSettings,
        "routing": RoutingSettings,
        "bulk": BulkSettings,
        "redis": RedisSettings,
        "scaling": ScalingSettings,
        "cache": CacheSettings,
    }
    candidate = nested.get(name) if cls is Settings else None
    return candidate if candidate and is_dataclass(candidate) else None
