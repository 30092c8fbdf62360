"""What the docs name exists: routes, query options, CLI flags, Makefile targets, the samples, the imports the
scripts make. The newcomer check (tools/newcomer_check.py, run by CI) runs the documented blocks for real; this
file catches, in a second and without any process, a name the docs still use after the code dropped it, and
a script that imports what a module no longer has (`make run` broke that way for several landings)."""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

from tools.newcomer_check import DOCUMENTS, documented_blocks

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "CONTRIBUTING.md",
    REPO_ROOT / "samples" / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
]


def _text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def _routes() -> set[tuple[str, str]]:
    """(method, rule) of every route the API serves, placeholders as <>."""
    from app import create_app
    from contract.settings.config import load_settings

    app = create_app(load_settings())
    return {
        (method, re.sub(r"<[^>]+>", "<>", rule.rule))
        for rule in app.url_map.iter_rules()
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")
    }


def test_every_route_the_docs_name_is_served():
    served = _routes()
    named = {
        (method, re.sub(r"[<{][^>}]+[>}]", "<>", path).rstrip(".,:;"))
        for method, path in re.findall(r"\b(GET|POST|DELETE|PUT|PATCH) (/[A-Za-z0-9_/<>{}.-]*)", _text())
    }
    assert named, "no route found in the docs: the pattern is wrong"
    assert named - served == set(), f"documented but not served: {sorted(named - served)}"


def test_every_query_option_the_docs_use_is_taken():
    from contract.documents import submit_query_model, wait_query_model
    from contract.settings.config import load_settings
    from contract.settings.models import model_references

    settings = load_settings()
    submit = set(submit_query_model(60000, tuple(model_references(settings)), 30).model_fields)
    read = set(wait_query_model(30).model_fields)
    used = re.findall(r"/v1/jobs(/[^?\s\"']*)?\?([A-Za-z0-9_=&.$:-]+)", _text())
    assert used
    for path, query in used:
        names = {pair.split("=")[0] for pair in query.split("&") if pair}
        taken = read if path else submit
        assert names <= taken, f"/v1/jobs{path}?{query}: {sorted(names - taken)} not taken"


def test_every_cli_flag_the_docs_use_exists():
    import argparse

    from imgserve_client.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    global_flags = {flag for a in parser._actions for flag in a.option_strings}
    uses = re.findall(r"imgserve (submit|status|cancel|models)\b([^\n`|]*)", _text())
    assert uses
    for command, rest in uses:
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest.split("#")[0]))
        known = global_flags | {flag for a in subcommands[command]._actions for flag in a.option_strings}
        assert flags <= known, f"imgserve {command}{rest}: {sorted(flags - known)} unknown"


def test_every_make_target_the_docs_name_exists():
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", _text()))
    named |= {
        line.split()[1]
        for block, _ in documented_blocks(REPO_ROOT, DOCUMENTS)
        for line in block.text.splitlines()
        if line.startswith("make ") and len(line.split()) > 1
    }
    assert {"run", "test"} <= named
    assert named <= targets, f"documented but not in the Makefile: {sorted(named - targets)}"
    run_local = (REPO_ROOT / "scripts" / "run-local").read_text()
    for choice in set(re.findall(r"make run REDIS=(\w+)", _text())):
        assert re.search(rf"\n *{choice}\)\n", run_local), f"make run REDIS={choice}: run-local has no such choice"


def test_every_runnable_block_is_python_or_shell_that_parses():
    blocks = list(documented_blocks(REPO_ROOT, DOCUMENTS))
    assert sum(runs for _, runs in blocks) >= 4 and any(not runs for _, runs in blocks)
    for block, _ in blocks:
        if block.language == "python":
            ast.parse(block.text, filename=block.where())


def _python_imports_in_shell(text: str) -> list[tuple[str, str]]:
    """(module, name) of each `from M import N` inside a `python -c "..."` of a shell script or Makefile."""
    found = []
    for snippet in re.findall(r"python3? -c [\"'](.*?)[\"']", text):
        for module, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", snippet):
            found += [(module, name.strip()) for name in names.split(",")]
    return found


def test_what_the_scripts_run_can_be_imported():
    """Every `python -c "from M import N"` and `python -m M` of scripts/, the Makefile, the Procfile and the
    compose file names something that exists (the stale import that broke `make run` was one of these)."""
    files = [
        *sorted((REPO_ROOT / "scripts").iterdir()),
        REPO_ROOT / "Makefile",
        REPO_ROOT / "Procfile",
        REPO_ROOT / "docker-compose.yml",
        REPO_ROOT / "Dockerfile",
    ]
    text = "\n".join(path.read_text() for path in files if path.is_file())
    for module, name in _python_imports_in_shell(text):
        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
    modules = set(re.findall(r"(?:python3?|\$python) -m ([a-z_][\w.]*)", text))
    modules |= set(re.findall(r"celery -A ([\w.]+)", text)) | set(re.findall(r'"-A", "([\w.]+)"', text))
    modules -= {"venv", "pip", "pytest", "coverage"}
    assert {"tools.procfile", "tools.run_settings", "tasks.worker", "tasks.flower", "gpu_worker"} <= modules
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"


def test_the_shipped_shapes_samples_are_what_their_script_makes(tmp_path):
    from training.samples import SEEDS, write_sample

    for seed in SEEDS:
        write_sample(seed, tmp_path)
        shipped = json.loads((REPO_ROOT / "samples" / f"shapes-{seed}.truth.json").read_text())
        assert json.loads((tmp_path / f"shapes-{seed}.truth.json").read_text()) == shipped
        assert (REPO_ROOT / "samples" / f"shapes-{seed}.jpg").stat().st_size > 10_000


def test_the_docs_server_takes_no_port_of_the_service():
    """`mkdocs serve` (which the Makefile suggested) took 8000, the API's; make docs-serve uses mkdocs.yml's."""
    import yaml

    dev_addr = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))["dev_addr"]
    service_ports = {8000, 5555, 9100, 9101, 9090, 3000, 6379}  # API, Flower, metrics, Prometheus, Grafana, Redis
    assert int(dev_addr.rsplit(":", 1)[1]) not in service_ports
    assert "mkdocs serve" in (REPO_ROOT / "Makefile").read_text().split("docs-serve:", 1)[1].split("\n\n")[0]


def test_what_the_examples_write_is_ignored_by_git():
    import subprocess

    written = ["shapes-36.boxes.png", "boxes/shapes-3.jpg", "client/build/lib/imgserve_client/cli.py"]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *written], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.stdout.split() == written


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_SPEC_PATH = re.compile(r"(?<![\w/.-])((?:configs|models)/[\w./-]+\.ya?ml)\b")


def _code_blocks() -> list[tuple[Path, str, str]]:
    return [(page, fence.group(1), fence.group(2)) for page in PAGES for fence in _FENCE.finditer(page.read_text())]


def test_every_config_or_spec_file_a_code_block_names_exists_or_is_made_by_the_docs():
    """Issue 60.4: models.md's example named `models/shapes-yolo.yaml`, a path that exists only beside the
    default config (configs/), not from the repository or a config of the reader's. A path counts as made by
    the docs when a block writes it (`> path`) or is it (its first line `# path`)."""
    blocks = _code_blocks()
    made = {path for _, _, text in blocks for path in re.findall(r">\s*(\S+\.ya?ml)", text)}
    made |= {text.splitlines()[0][2:].strip() for _, _, text in blocks if text.startswith("# ")}
    named = {(page.name, path) for page, _, text in blocks for path in _SPEC_PATH.findall(text)}
    assert named, "no code block names a config or spec file: the pattern no longer matches the docs"
    missing = sorted((page, path) for page, path in named if path not in made and not (REPO_ROOT / path).exists())
    assert not missing, f"code blocks name config or spec files that do not exist: {missing}"


def test_the_several_models_example_loads_as_it_is_written(tmp_path):
    """The models.md example, copied into a config of the reader's (outside the repository), is a deployment."""
    from contract.settings.config import load_settings

    page = REPO_ROOT / "docs" / "models.md"
    example = next(text for _, lang, text in _code_blocks() if lang == "yaml" and text.startswith("models:"))
    assert example in page.read_text()
    config = tmp_path / "mine.yaml"
    config.write_text(example)
    settings = load_settings(config)
    assert [spec.key for spec in settings.models] == [
        "shapes-yolo:2.0.0",
        "shapes-yolo:3.0.0",
        "tiny-yolo:0.1.0-random",
    ]
