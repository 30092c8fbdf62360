"""Product comments say why; measured figures live in dated logs (docs/benchmarks/), issue numbers in git log.

Only the kinds of figure that are never a configured limit or a protocol constant are caught: a count of
microseconds or instructions, Redis's `used_memory` beside a number, a profiler cited, an issue's number. A
comment may still name a limit ("12 ms window", "1 MiB a chunk"): those are settings, not measurements.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("app", "tasks", "gpu_worker", "contract", "tools", "client")
_NUMBER = r"~?\d[\d,.]*\s*(?:[kKM]\s*)?"
MEASURED = re.compile(
    rf"{_NUMBER}µs\b"  # a timing a run took
    rf"|{_NUMBER}instructions\b"  # a count `bench instructions` or `bench plane` took
    r"|\bused_memory\b[^.;]{0,40}?\d[\d,.~-]*\s*(?:bytes|[KMG]i?B)\b"  # what Redis's memory grew by
    r"|\b(?:py-spy|callgrind|cProfile)\b"  # a profile's finding
    r"|\bissues?\s*#?\d+",  # git log holds those
    re.IGNORECASE,
)


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found += [(first.lineno + n, line) for n, line in enumerate(first.value.value.splitlines())]
    return found


def comments_of(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a Python file, or every `--` comment of a Lua file."""
    source = path.read_text()
    if path.suffix == ".lua":
        return [(n, line.split("--", 1)[1]) for n, line in enumerate(source.splitlines(), 1) if "--" in line]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = [(token.start[0], token.string) for token in tokens if token.type == tokenize.COMMENT]
    return comments + _docstrings(ast.parse(source))


def product_files() -> list[Path]:
    return sorted(
        path
        for top in PRODUCT
        for path in (REPO_ROOT / top).rglob("*")
        if path.suffix in (".py", ".lua") and "__pycache__" not in path.parts
    )


def test_the_pattern_catches_each_kind_and_leaves_limits_alone():
    caught = [
        "a step's arguments cost Redis ~760 instructions each",
        "about 1.2 M instructions an image",
        "the read took 45 µs of Redis's main thread",
        "grew used_memory by ~770-850 bytes a hit",
        "(py-spy: a third of the API worker's CPU in socket sends)",
        "Issue 60.3: which API a message is about",
        "see issue #58",
    ]
    left = [
        "a batch's window (12 ms) spans several looks (2 ms apart)",
        "1 MiB inflated a chunk, 64 Mi characters in all",
        "an id issued to another key",
        "what the instructions of a step are (contract/library/)",
        "Redis's used_memory, from INFO",
        "used_memory / maxmemory (0 when Redis has no maxmemory)",
    ]
    assert [text for text in caught if not MEASURED.search(text)] == []
    assert [text for text in left if MEASURED.search(text)] == []


def test_product_comments_carry_no_measured_figure_or_issue_number():
    files = product_files()
    assert len(files) > 150 and any(path.suffix == ".lua" for path in files)  # the walk reaches the product
    intake = comments_of(REPO_ROOT / "contract" / "jobs" / "intake.py")
    assert any("lookup_or_admit" in text for _, text in intake)  # comments are read, not only docstrings
    found = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {text.strip()}"
        for path in files
        for line, text in comments_of(path)
        if MEASURED.search(text)
    ]
    assert found == [], "a figure belongs in docs/benchmarks/ (a comment may point there): " + "\n".join(found)
