"""The bench's wings: each family of modules in a folder of its own, on a floor, and no import up a floor.

A wing may import its own modules and those of the wings on floors below it, never a wing on its own floor or above: the
stack (processes, local stacks, hosts) is the ground that every measurement stands on; the meters measure one part
alone; the load drives a whole deployment and reads the meters; faults, hostile tenants and the soak are load with
something more; the CLI sits on top (bench/commands/, and over them bench/__main__.py) and only dispatches. Lazy imports
inside functions count too. A module loose in bench/ would have no floor, so only the CLI's entry is allowed there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH = REPO_ROOT / "bench"
FLOORS = {"stack": 0, "meters": 1, "load": 2, "faults": 3, "hostile": 3, "soak": 3, "commands": 4}
TOP_FILES = {"__init__.py": 5, "__main__.py": 5}  # the CLI's entry, over its commands
# Put first on a child process's PYTHONPATH as `sitecustomize`, also by older checkouts' processes: they import
# nothing of the bench.
HOOKS = {"meters/round_trips/sitecustomize.py", "stack/skew/sitecustomize.py"}


def _floor_of(relative: Path) -> int | None:
    if len(relative.parts) == 1:
        return TOP_FILES.get(relative.name)
    return FLOORS.get(relative.parts[0])


def _bench_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every bench module an import in `source` names, lazy ones too; `from bench import X` as
    bench.X and `from bench.load import X` as bench.load.X."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "bench"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "."))  # relative: which wing it reaches is not in its text
            elif node.module and node.module.split(".")[0] == "bench":
                found.append((node.lineno, node.module))
                if node.module.count(".") < 2:
                    found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _upward(relative: Path, source: str) -> list[str]:
    """What the module at bench/`relative` imports against the rule, one line each."""
    floor, wrong = _floor_of(relative), []
    for line, name in _bench_imports(source):
        where = f"bench/{relative}:{line} imports {name}"
        parts = name.split(".")
        if str(relative) in HOOKS:
            wrong.append(f"{where} (a hook imports nothing of the bench)")
        elif name == ".":
            wrong.append(f"{where} (spell the wing out)")
        elif len(parts) > 1 and parts[1] != relative.parts[0]:  # not the package itself, nor its own wing
            target = FLOORS.get(parts[1], TOP_FILES.get(f"{parts[1]}.py"))
            if floor is None or target is None or target >= floor:
                wrong.append(f"{where} (floor {target} from floor {floor})")
    return wrong


def test_every_bench_module_sits_in_a_wing_or_is_the_clis_entry():
    loose = [
        str(path.relative_to(REPO_ROOT))
        for path in sorted(BENCH.rglob("*.py"))
        if _floor_of(path.relative_to(BENCH)) is None and str(path.relative_to(BENCH)) not in HOOKS
    ]
    assert loose == [], f"each module belongs to a wing folder ({', '.join(FLOORS)}): {loose}"
    assert all((BENCH / wing / "__init__.py").is_file() for wing in FLOORS)
    assert sorted(p.name for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(FLOORS)


def test_no_wing_imports_a_wing_on_its_floor_or_above():
    wrong = [
        line for path in sorted(BENCH.rglob("*.py")) for line in _upward(path.relative_to(BENCH), path.read_text())
    ]
    assert wrong == [], "\n".join(wrong)


def test_the_rule_sees_an_import_up_a_floor_or_across_one_by_any_spelling():
    """The check above passes on a tree it cannot read: here it must see what it exists to refuse."""
    lazy_up = "def f():\n    from bench.load import runs\n    import bench.soak.run\n"
    assert [name for _, name in _bench_imports(lazy_up)] == ["bench.load", "bench.load.runs", "bench.soak.run"]
    assert len(_upward(Path("stack/x.py"), lazy_up)) == 3
    assert _upward(Path("soak/x.py"), "from bench.load import client\nfrom bench.stack.local import LocalStack\n") == []
    assert _upward(Path("hostile/x.py"), "from bench.soak import run\n")  # a sibling on the same floor
    assert _upward(Path("load/x.py"), "from bench.commands import common\n")
    assert _upward(Path("faults/x.py"), "from .harness import Log\n")
    assert _upward(Path("stack/skew/sitecustomize.py"), "import bench.stack.hosts\n")
    assert _upward(Path("commands/x.py"), "from bench.hostile import files\nfrom bench.soak.run import main\n") == []


# What the code and the docs name of the bench: a dotted module (bench.load.runs, bench.stack.local.ProcfileStack)
# or a path (bench/meters/plane.py, bench/stack/skew/). README.md and CHANGELOG.md keep what was run at the time.
_NAMED = ("bench", "tests", "tools", "scripts", "docs", "configs")
_DOTTED = re.compile(r"(?<![\w./-])bench\.([a-z_]+)(?:\.([a-z_]+))?")
_PATH = re.compile(r"(?<![\w.])bench/([a-z_/]+?)(\.py\b|/)")


def test_every_bench_module_the_code_and_docs_name_exists():
    files = [p for folder in _NAMED for p in (REPO_ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".conf")]
    files += [REPO_ROOT / name for name in ("CONTRIBUTING.md", "Makefile", "pyproject.toml", "mkdocs.yml")]
    files += [p for p in (REPO_ROOT / "scripts").iterdir() if p.is_file()]
    missing = []
    for path in files:
        text = path.read_text()
        for match in _DOTTED.finditer(text):
            wing, module = match.groups()
            if wing == "__main__":
                continue
            exists = (BENCH / wing).is_dir() and (module is None or (BENCH / wing / f"{module}.py").is_file())
            if not exists:
                missing.append(f"{path.relative_to(REPO_ROOT)}: {match.group(0)}")
        for match in _PATH.finditer(text):
            named = BENCH / (match.group(1) + (".py" if match.group(2) == ".py" else ""))
            if not named.exists():
                missing.append(f"{path.relative_to(REPO_ROOT)}: {match.group(0)}")
    assert missing == [], "\n".join(missing)
