"""Product comments say why; measured figures live in dated logs (docs/benchmarks/), issue numbers in git log.

Only the kinds of figure that are never a configured limit or a protocol constant are caught: a count of
microseconds or instructions (or its order: "hundreds of instructions"), Redis's `used_memory` beside a number, a
profiler cited, a count a run reached written with thousands commas ("6,000 requests", "2,978 times"; a limit, "at
most", "up to" or "the last" so many, is left), what a step took ("read 14 ms", "took 45 microseconds", "p99 was 180
ms"), a before and after ("went from", "180 ms -> 95 ms"), a ratio ("3.2x", "3.2 times cheaper"), a percentage
outside contract/settings/ (where a setting's doc says what its value means), an issue's or a pull request's number
("issue 58", "#58", "PR 58", "gh-58", .../issues/58). A comment may still name a limit ("12 ms window", "1 MiB a
chunk"): those are settings, not measurements.
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
_UNIT = r"(?:ns|µs|us|ms|s|%|x|[KMG]i?B)"
MEASURED = re.compile(
    rf"(?<![\w.]){_NUMBER}(?:µs|us)\b"  # a timing a run took
    rf"|{_NUMBER}instr(?:uctions\b|\.)"  # a count `bench instructions` or `bench plane` took
    r"|\b(?:tens|hundreds|thousands|millions|billions)\s+of\s+instructions\b"  # ... or its order
    r"|\bused_memory\b[^.;]{0,40}?\d[\d,.~-]*\s*(?:bytes|[KMG]i?B)\b"  # what Redis's memory grew by
    r"|\b(?:py-spy|callgrind|cProfile)\b"  # a profile's finding
    r"|(?<!\bmost )(?<!\bto )(?<!\blast )\b\d{1,3}(?:,\d{3})+\s+[a-z]+s\b"  # a count a run reached
    r"|\b(?:took|read|measured|spent|cost)\s+(?:about\s+|~)?\d[\d,.]*\s*(?:ns|µs|us|ms|s|(?:milli)?seconds?)\b"  # took
    r"|\b(?:went|dropped|fell|rose|grew|climbed)\s+from\s+~?\d"  # a before and after
    rf"|\d[\d.,]*\s*{_UNIT}\s*(?:->|→)\s*~?\d"  # the same, as an arrow
    r"|(?<![\w.])\d+(?:\.\d+)?[x×](?!\w)"  # a ratio between two runs
    r"|\b\d[\d,.]*\s*(?:nano|micro)seconds?\b"  # a timing, its unit spelled out
    r"|\bp\d{2}\s+(?:was|of|at)\s+~?\d"  # a latency percentile a run read
    r"|(?<![\w.])\d+(?:\.\d+)?\s+times\s+(?:cheaper|faster|slower|costlier|more|less|fewer)\b"  # a ratio
    r"|\bissues?\s*#?\d+|(?<![\w&])#\d+\b|\bPR\s*#?\d+\b|\bgh-\d+\b|/(?:issues|pull)/\d+",  # git log holds those
    re.IGNORECASE,
)
PERCENT = re.compile(r"\d[\d.]*\s*%")  # a share a run measured; a setting's doc (contract/settings/) may say one
SETTINGS = Path("contract") / "settings"


def figures_in(path: Path, text: str) -> bool:
    """Whether a comment line of `path` (relative to the repository) carries a measured figure or an issue's number."""
    return bool(MEASURED.search(text) or (PERCENT.search(text) and SETTINGS not in path.parents))


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """Every string that stands as a statement: docstrings, and the strings written as comments anywhere else (after
    an assignment, mid-body), which Python keeps in the source as a docstring is."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found += [(node.lineno + n, line) for n, line in enumerate(node.value.value.splitlines())]
    return found


def _lua_comments(source: str) -> list[tuple[int, str]]:
    """Every `--` comment of a Lua file, and each line of its `--[[ ... ]]` blocks."""
    found, in_block = [], False
    for n, line in enumerate(source.splitlines(), 1):
        if in_block:
            found.append((n, line))
            in_block = "]]" not in line
        elif "--" in line:
            comment = line.split("--", 1)[1]
            found.append((n, comment))
            in_block = comment.startswith("[[") and "]]" not in comment
    return found


def comments_of(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a Python file, or every `--` comment of a Lua file."""
    source = path.read_text()
    if path.suffix == ".lua":
        return _lua_comments(source)
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
        "6,000 requests had queued the same job 2,978 times",
        "a cheaper plane read 14 ms for 30 images",
        "p95 went from 180 ms to 95 ms",
        "the file 80 s -> 56 s",
        "a call into C costs Redis hundreds of instructions",
        "each argument ~760 instr. more",
        "the read took 45 us",
        "a refusal 3.2x cheaper",
        "the share rose (#58)",
        "as PR 58 found",
        "since gh-58",
        "the claim took 45 microseconds",
        "p99 was 180 milliseconds",
        "the read took 180 milliseconds",
        "a table reply is 3.2 times costlier",
        "see https://github.com/celery/kombu/issues/58",
    ]
    left = [
        "a batch's window (12 ms) spans several looks (2 ms apart)",
        "1 MiB inflated a chunk, 64 Mi characters in all",
        "an id issued to another key",
        "what the instructions of a step are (contract/library/)",
        "Redis's used_memory, from INFO",
        "used_memory / maxmemory (0 when Redis has no maxmemory)",
        "the last 10,000 tasks in memory",
        "at most 1,000 detections, up to 65,536 bytes",
        "Pillow's own (89,478,485 by default)",
        "a 640x480 image, a 0x1F byte",
        "held + this one <= share x (limit - the rest) / limit",
        "args[#args + 1], the 2nd look",
        "a read takes one round trip",
        "a deadline in milliseconds, a window of 12 milliseconds",
        "tried three times more",
    ]
    outside, settings = Path("app") / "uploads.py", SETTINGS / "__init__.py"
    assert [text for text in caught if not figures_in(outside, text)] == []
    assert [text for text in left if figures_in(outside, text)] == []
    # a percentage: a share measured, unless a setting's doc says what its value means
    assert figures_in(outside, "the API's CPU fell by 40%") and not figures_in(settings, "under 90% of its 1 GB")


def test_product_comments_carry_no_measured_figure_or_issue_number():
    files = product_files()
    assert len(files) > 150 and any(path.suffix == ".lua" for path in files)  # the walk reaches the product
    intake = comments_of(REPO_ROOT / "contract" / "jobs" / "intake.py")
    assert any("lookup_or_admit" in text for _, text in intake)  # comments are read, not only docstrings
    found = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {text.strip()}"
        for path in files
        for line, text in comments_of(path)
        if figures_in(path.relative_to(REPO_ROOT), text)
    ]
    assert found == [], "a figure belongs in docs/benchmarks/ (a comment may point there): " + "\n".join(found)
