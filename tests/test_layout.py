"""The code's seams: the three processes meet only in contract/, and no import circle between the project's
modules (lazy imports inside functions too)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "contract", "tasks", "gpu_worker", "bench", "baseline", "tools", "training")
# The API, the CPU (and callback) workers and the GPU worker: separate processes, deployed apart (the GPU image
# carries no app/ or tasks/). What two of them share is the contract's, which imports none of them.
PROCESSES = ("app", "tasks", "gpu_worker")
# Every top-level name of this repository's own code (client/ is installed as imgserve_client).
PROJECT = (*PACKAGES, "tests", "imgserve_client", "client")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found.update(name for name in names if name in modules)
    return found


def imported_names(path: Path) -> list[tuple[int, str]]:
    """Every name an import in `path` reaches (lazy ones too), with its line: `from a.b import c` as a.b.c (so
    `from contract import jobs` names the package it takes); a relative import as '.'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." if node.level else node.module or ""
            found += [(node.lineno, module if node.level else f"{module}.{alias.name}") for alias in node.names]
    return found


def test_each_process_imports_only_the_contract_and_its_own_modules():
    """app/, tasks/ and gpu_worker/ import contract/ and themselves; contract/ imports only itself."""
    crossings = []
    for package in (*PROCESSES, "contract"):
        allowed = {package, "contract"}
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            for line, name in imported_names(path):
                top = name.split(".")[0]
                if name == "." or (top in PROJECT and top not in allowed):
                    crossings.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {name}")
    assert crossings == [], "\n".join(crossings)


# contract/'s packages by concept, lowest first: a package imports only itself and those before it here, never one
# after it (no arrow back up, so no circle between them either). The settings read no Redis; the jobs know no frames;
# the documents are what the rest make. contract/__init__.py lists them in this order.
CONTRACT_FLOORS = (
    "settings",
    "runtime",
    "library",
    "redis",
    "admission",
    "cache",
    "jobs",
    "workers",
    "frames",
    "callbacks",
    "documents",
)


def contract_packages_imported(path: Path) -> list[tuple[int, str]]:
    """The contract packages an import in `path` reaches (lazy ones too), with its line."""
    return [(line, name.split(".")[1]) for line, name in imported_names(path) if name.startswith("contract.")]


def test_contract_is_packages_by_concept_each_importing_only_the_floors_below_it():
    contract = REPO_ROOT / "contract"
    assert sorted(p.name for p in contract.glob("*.py")) == ["__init__.py"], "a module outside contract's packages"
    packages = {p.name for p in contract.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(CONTRACT_FLOORS)
    floor = {name: index for index, name in enumerate(CONTRACT_FLOORS)}
    up = []
    for path in sorted(contract.rglob("*.py")):
        own = path.relative_to(contract).parts[0]
        for line, package in contract_packages_imported(path):
            if own in floor and floor.get(package, len(floor)) > floor[own]:
                up.append(f"{path.relative_to(REPO_ROOT)}:{line} ({own}) imports contract.{package}")
    assert up == [], "\n".join(up)
    index = ast.get_docstring(ast.parse((contract / "__init__.py").read_text())) or ""
    listed = [line.split("`")[1] for line in index.splitlines() if line.startswith("- `")]
    assert listed == list(CONTRACT_FLOORS), "contract/__init__.py's index, in the floors' order"


def test_the_floor_check_sees_an_arrow_back_up(tmp_path):
    """A settings module that imported the workers' scaling (which reads Redis) is what the floors refuse."""
    path = tmp_path / "settings_module.py"
    path.write_text("from contract.workers.scaling import pool_wanted\nfrom contract import redis, jobs\n")
    assert contract_packages_imported(path) == [(1, "workers"), (2, "redis"), (2, "jobs")]


# tasks/ in three parts: the hop (the Celery plumbing every worker runs), decoding and callbacks. Decoding and callbacks
# may use the hop; the hop uses neither, and neither uses the other. The two modules Celery is started on
# (tasks.worker, tasks.flower) wire them together, at the top.
TASKS_PARTS = {"hop": {"hop"}, "decoding": {"decoding", "hop"}, "callbacks": {"callbacks", "hop"}}
TASKS_ENTRY_POINTS = {"__init__.py", "worker.py", "flower.py"}


def test_the_parts_of_tasks_import_only_themselves_and_the_hop():
    assert {path.name for path in (REPO_ROOT / "tasks").glob("*.py")} == TASKS_ENTRY_POINTS
    assert {path.name for path in (REPO_ROOT / "tasks").iterdir() if path.is_dir() and path.name != "__pycache__"} == (
        set(TASKS_PARTS)
    )
    crossings = []
    for part, allowed in TASKS_PARTS.items():
        for path in sorted((REPO_ROOT / "tasks" / part).rglob("*.py")):
            for line, name in imported_names(path):
                parts = name.split(".")
                if parts[0] == "tasks" and (len(parts) < 2 or parts[1] not in allowed):
                    crossings.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {name}")
    assert crossings == [], "\n".join(crossings)


def test_no_import_circle_between_the_projects_modules():
    paths = {module_name(p): p for package in PACKAGES for p in (REPO_ROOT / package).rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}
    # A package's __init__ importing its own modules is how packages work, not a circle of concepts.
    for name in graph:
        graph[name] = {
            other for other in graph[name] if not (name.startswith(other + ".") and paths[other].name == "__init__.py")
        }
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(trail[trail.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], "\n".join(" -> ".join(c) for c in circles)


def test_the_architecture_page_names_every_redis_key():
    from contract.redis.keys import Keys

    page = (REPO_ROOT / "docs" / "architecture.md").read_text()
    internal = {"namespace", "tenant_of_queue", "preprocess_queues"}  # helpers, not keys
    missing = [
        name for name in dir(Keys) if not name.startswith("_") and name not in internal and f"| `{name}` |" not in page
    ]
    assert missing == [], f"docs/architecture.md's key table lacks {missing}"


def test_the_letterbox_geometry_is_one_type_and_its_batch_form_has_the_same_fields():
    import dataclasses

    from contract.frames import MAPPING_FIELDS, PLACEMENT_FIELDS, FrameHeader
    from gpu_worker.postprocess import Geometry
    from gpu_worker.staging import PARAM_COLUMNS

    header_fields = [f.name for f in dataclasses.fields(FrameHeader)]
    assert header_fields[1 : 1 + len(PLACEMENT_FIELDS)] == list(PLACEMENT_FIELDS)  # carried flat, in order
    assert set(MAPPING_FIELDS) <= set(PLACEMENT_FIELDS)
    assert tuple(f.name for f in dataclasses.fields(Geometry)) == MAPPING_FIELDS
    assert PARAM_COLUMNS[-len(MAPPING_FIELDS) :] == MAPPING_FIELDS


# The map a newcomer reads first (docs/architecture.md) is held to the tree, in place of a cap on a module's length:
# a file is as long as its one concept, and where each concept lives is the question the map answers.
_ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
_MAPPED = ("contract", "app", "tasks", "gpu_worker", "tools", "client")
_ROW = re.compile(r"^\| `([\w./]+)` \| (.*?) \|$")


def architecture_map() -> dict[str, str]:
    """The "Where each part lives" tables: each row's path (a folder ends in /) and what it says the path holds."""
    section = _ARCHITECTURE.read_text().split("## Where each part lives", 1)[1].split("\n## ", 1)[0]
    rows = [row.groups() for line in section.splitlines() if (row := _ROW.match(line))]
    named = [path for path, _ in rows]
    assert len(named) == len(set(named)), f"a path mapped twice: {sorted(p for p in named if named.count(p) > 1)}"
    return dict(rows)


def _only_an_index(init: Path) -> bool:
    """An __init__.py with nothing but its docstring: its folder's row stands for it."""
    body = ast.parse(init.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def mapped_modules() -> set[str]:
    """What the map must name: every product module (contract/'s Lua steps too), an index-only package as its folder."""
    wanted = set()
    for top in _MAPPED:
        for path in (REPO_ROOT / top).rglob("*"):
            if "__pycache__" in path.parts or path.suffix not in (".py", ".lua"):
                continue
            relative = str(path.relative_to(REPO_ROOT))
            if path.name == "__init__.py" and _only_an_index(path):
                relative = str(path.parent.relative_to(REPO_ROOT)) + "/"
            wanted.add(relative)
    return wanted


def test_the_architecture_map_names_every_module_and_only_what_the_tree_holds():
    mapped = architecture_map()
    assert {"contract/jobs/intake.py", "tasks/hop/broker.py", "app/job_lookup.py", "tools/procfile.py"} <= set(mapped)
    assert "contract/library/head.lua" in mapped and "contract/jobs/" in mapped  # Lua steps and folders are read
    assert sorted(path for path, holds in mapped.items() if len(holds.strip()) < 10) == [], "a row says what it holds"
    missing = sorted(path for path in mapped if not (REPO_ROOT / path).exists())
    assert missing == [], "docs/architecture.md's map names what the tree does not hold"
    wanted = mapped_modules()
    assert len(wanted) > 150
    unmapped = sorted(wanted - set(mapped))
    assert unmapped == [], "a module docs/architecture.md's map does not place (a row in its room's table)"
    first = _ARCHITECTURE.read_text().split("## Where to look first", 1)[1].split("\n## ", 1)[0]
    pointed = set(re.findall(r"`((?:app|tasks|gpu_worker|contract|bench|tools)/[\w/]+\.(?:py|lua))`", first))
    assert len(pointed) >= 10 and sorted(p for p in pointed if not (REPO_ROOT / p).is_file()) == []


# A role's command line, spelled out: `-m gpu_worker --device`, `-m gunicorn -c configs/gunicorn.conf.py`, `celery
# ... worker -Q preprocess` (issue 63, item 5). bench/stack/processes.py builds them (api_argv, cpu_worker_argv,
# gpu_worker_argv). (The deployments' own lines: the Procfile, the compose files, tools/kubernetes.py's manifests.)
_ROLE_COMMAND_LINES = ('"gpu_worker", "--device"', '"gunicorn", "-c"', '"worker", "-Q", "preprocess"')
_ROLE_COMMAND_LINES_HOME = ("bench/stack/processes.py",)


def test_role_command_lines_are_built_in_one_place():
    spelled = []
    for folder in ("bench", "tests"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            relative = str(path.relative_to(REPO_ROOT))
            if relative in _ROLE_COMMAND_LINES_HOME or path.name == "test_layout.py":
                continue
            text = " ".join(path.read_text().split())  # a call black spread over lines reads as one
            spelled += [f"{relative}: {line}" for line in _ROLE_COMMAND_LINES if line in text]
    assert not spelled, spelled
