"""Every `python -m ...` command and every configuration example in README.md and docs/ parses as written (issue
60: "every command and config example runs as written, and a test proves it").

The newcomer check (tools/newcomer_check.py, CI) runs README.md's and the quick start's blocks for real; the other
pages' commands start stacks, load GPUs or take minutes, so here each one is given to its own module's argument
parser exactly as the page writes it (a flag renamed, a value of the wrong type, a subcommand gone: the parser
refuses it, naming the page and line), and each YAML example is loaded by the settings or the model-spec loader.
Dated measurement logs (docs/benchmarks/) record what was run then, and are left as they were."""

from __future__ import annotations

import argparse
import runpy
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

# Modules a page runs with `python -m`, whose arguments argparse reads.
ARGPARSE_MODULES = {
    "app.auth",
    "bench",
    "bench.hostile.dns",
    "bench.hostile.hits",
    "baseline",
    "gpu_worker",
    "tools.redis_ha",
    "tools.releases",
    "tools.restore",
    "tools.kubernetes",
    "tools.kubernetes_check",
    "tools.export_pt2",
    "training.train_shapes",
    "training.evaluate_service",
    "training.export_program",
}


class Parsed(Exception):
    """Raised by the patched parse_args once the arguments parsed: nothing of the command runs."""


def _fences(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line of the fence, language, lines) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```") and lines[i].strip() != "```":
            start, language, body = i + 1, lines[i][3:].strip(), []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            yield start, language, body
        i += 1


def _commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv after `-m`) of every `python -m` command in a bash block of the pages."""
    found = []
    for page in PAGES:
        for start, language, body in _fences(page.read_text()):
            if language not in ("bash", "sh"):
                continue
            joined: list[tuple[int, str]] = []
            for offset, line in enumerate(body):
                if joined and joined[-1][1].endswith("\\"):
                    joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
                else:
                    joined.append((start + offset + 1, line))
            for number, line in joined:
                for words in _and_lists(shlex.split(line, comments=True)):
                    if "-m" not in words or not any(w.endswith("python") or w.endswith("python3") for w in words):
                        continue
                    argv = words[words.index("-m") + 1 :]
                    # the shell's: a redirection or a pipe ends the command's own arguments
                    ends = [i for i, word in enumerate(argv) if word in {"|", ">", ">>", "<", "2>", "&"}]
                    argv = argv[: ends[0]] if ends else argv
                    # [--flag value]: an optional part, shown in brackets; given here as written inside them
                    argv = [word.strip("[]") for word in argv if not word or word.strip("[]")]
                    found.append((f"{page.relative_to(REPO_ROOT)}:{number}", argv))
    return found


def _and_lists(words: list[str]) -> list[list[str]]:
    """A line's commands joined by `&&` (split after quoting: an `&&` inside a quoted `sh -c` stays)."""
    parts: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            parts.append([])
        else:
            parts[-1].append(word)
    return parts


COMMANDS = _commands()


def test_the_pages_hold_python_m_commands_to_check():
    modules = {argv[0] for _, argv in COMMANDS}
    assert {"bench", "training.train_shapes", "training.evaluate_service"} <= modules, modules
    assert len(COMMANDS) >= 25


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_each_python_m_command_of_the_docs_parses_as_written(where, argv, monkeypatch, capsys):
    module, args = argv[0], argv[1:]
    assert module in ARGPARSE_MODULES, f"{where}: python -m {module}: a module this test does not know"
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise Parsed(original(self, *a, **k))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises((Parsed, SystemExit)) as outcome:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    if outcome.type is SystemExit:
        pytest.fail(f"{where}: python -m {' '.join(argv)} is refused: {capsys.readouterr().err.strip()}")


def _yaml_examples() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(REPO_ROOT)}:{start}", "\n".join(body))
        for page in PAGES
        for start, language, body in _fences(page.read_text())
        if language == "yaml"
    ]


YAML_EXAMPLES = _yaml_examples()


@pytest.mark.parametrize(("where", "text"), YAML_EXAMPLES, ids=[where for where, _ in YAML_EXAMPLES])
def test_each_yaml_example_of_the_docs_loads(where, text, tmp_path, monkeypatch):
    """A model spec (it has `name:` and `layout:`) loads as a spec (an example of the reader's may name weights that
    are theirs, not here); anything else is a settings overlay, loaded over the defaults."""
    import yaml

    from contract.settings.config import load_settings

    document = yaml.safe_load(text)
    assert isinstance(document, dict) and document, f"{where}: not a mapping"
    if "apiVersion" in document and "kind" in document:  # a Kubernetes object: as tools.kubernetes renders it
        from tools.kubernetes import CPU_WANTED_QUERY, render

        [rendered] = [o for o in render("i", "g", "p") if o["kind"] == document["kind"]]
        assert document["metadata"]["name"] == rendered["metadata"]["name"], where
        if document["kind"] == "ScaledObject":
            assert [t["metadata"]["query"] for t in document["spec"]["triggers"]] == [CPU_WANTED_QUERY], where
            assert set(document["spec"]) <= set(rendered["spec"]), where
        return
    if "name" in document and "layout" in document:
        from contract.settings.config import load_model_spec

        # as a spec file beside the shipped ones (configs/models/), whose relative paths resolve from there
        spec = load_model_spec(document, REPO_ROOT / "configs" / "models")
        assert (spec.name, spec.layout) == (document["name"], document["layout"]), where
        return
    for name in _env_names(document):
        monkeypatch.setenv(name, "an example secret of 32 characters or more!")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(text)
    load_settings(overlay)


def _env_names(document: Any) -> set[str]:
    """The environment variables an example's `*_env` fields name (a callback secret's, say)."""
    if isinstance(document, dict):
        names = {value for key, value in document.items() if str(key).endswith("_env") and isinstance(value, str)}
        return names.union(*(_env_names(value) for value in document.values()))
    if isinstance(document, list):
        return set().union(*(_env_names(value) for value in document))
    return set()


def test_a_spec_version_yaml_reads_as_a_date_is_kept_and_one_it_reads_as_a_number_is_refused_with_the_fix():
    """docs/models.md's own example wrote `version: 2024-05-01`, which YAML reads as a date: the spec was refused
    ("Input should be a valid string"). A date's text survives, so it is kept; `1.10` read as 1.1 does not."""
    import yaml

    from contract.settings.config import load_model_spec
    from contract.settings.sections import SettingsError

    base = {"name": "m", "format": "builtin", "layout": "yolov8", "labels": ["a"], "input_size": 64}
    dated = load_model_spec({**base, **yaml.safe_load("version: 2024-05-01")}, REPO_ROOT)
    assert dated.version == "2024-05-01"
    with pytest.raises(SettingsError, match=r'write it in quotes \(version: "1.1"'):
        load_model_spec({**base, **yaml.safe_load("version: 1.10")}, REPO_ROOT)


def test_each_docker_compose_command_of_the_docs_names_files_services_and_profiles_that_exist():
    import yaml

    lines = [
        (f"{page.relative_to(REPO_ROOT)}:{start + offset + 1}", line)
        for page in PAGES
        for start, language, body in _fences(page.read_text())
        if language in ("bash", "sh")
        for offset, line in enumerate(body)
        if "docker compose" in line or "docker-compose " in line
    ]
    assert len(lines) >= 5
    for where, line in lines:
        words = shlex.split(line.removesuffix("\\"), comments=True)  # a line continued: its own words
        files = [words[i + 1] for i, word in enumerate(words) if word == "-f"] or ["docker-compose.yml"]
        services: dict[str, Any] = {}
        for name in files:
            assert (REPO_ROOT / name).is_file(), f"{where}: no {name}"
            services.update(yaml.safe_load((REPO_ROOT / name).read_text())["services"])
        profiles = {profile for service in services.values() for profile in service.get("profiles", [])}
        for i, word in enumerate(words):
            if word == "--scale":
                assert words[i + 1].split("=")[0] in services, f"{where}: no service {words[i + 1]}"
            if word == "--profile":
                assert words[i + 1] in profiles, f"{where}: no profile {words[i + 1]}"
