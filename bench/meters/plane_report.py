"""What `bench plane` prints: each step's cost an image on the control plane (µs, commands, round trips,
instructions), side by side, the ceiling that sets, and what is reported apart from an image's figures."""

from __future__ import annotations

from statistics import median
from typing import Any

PHASES = ("intake", "cpu", "gpu", "read")
# Reported apart, not in an image's figures: the first submissions, while the deadline index is still a listpack
# (each insert walks it: the phased bench holds every job at once, so it pays this once, up to the listpack's
# size); the first answers, while the result cache's LRU index is a listpack (each answer's ZADD walks it, once a
# cache's life); the CPU worker's start (its connections, kombu's bindings and scripts, Celery's events, the library
# check: once a process); and the GPU worker's start (its SCAN for lists nobody reads, the requeue, the epoch: once a
# start).
APART = ("intake-listpack", "gpu-listpack", "cpu-start", "gpu-start")


def report(sides: dict[str, dict[str, Any]]) -> str:
    names = list(sides)
    lines = [
        "## The control plane per image (`bench plane`: Redis's own INFO, phase by phase)",
        "",
        f"{next(iter(sides.values()))['images']} images of 640x16 (no decode cost), "
        f"{next(iter(sides.values()))['shards']} bulk shard(s); µs: the control plane's main-thread CPU; each step "
        "less what the control plane spends idle for as long as the step lasted (the idle row below).",
        "",
        "| step | " + " | ".join(f"{n}: µs | {n}: commands" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for phase in (*PHASES, "total"):
        cells = []
        for side in sides.values():
            cost = side["total"] if phase == "total" else side["phases"][phase]
            cells += [f"{cost.us:.0f}", f"{cost.commands:.1f}"]
        lines.append(f"| {'**all**' if phase == 'total' else phase} | " + " | ".join(cells) + " |")
    if all(side["total"].instructions is not None for side in sides.values()):
        lines += [
            "",
            "Redis's user-space instructions an image (under callgrind: µs above are valgrind's, not the real ones; "
            "the kernel's socket work is not counted):",
            "",
            "| step | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for phase in (*PHASES, "total"):
            counts = [
                (side["total"] if phase == "total" else side["phases"][phase]).instructions for side in sides.values()
            ]
            lines.append(f"| {phase} | " + " | ".join(f"{count:,.0f}" for count in counts if count is not None) + " |")
    lines += _round_trips(sides) + _cache_apart(sides) + _apart(sides)
    lines += ["", "| ceiling | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines.append(
        "| images/s per control-plane core (100%) | "
        + " | ".join(f"{1e6 / s['total'].us:,.0f}" for s in sides.values())
        + " |"
    )
    lines.append(
        "| images/s at 70% of it | " + " | ".join(f"{0.7e6 / s['total'].us:,.0f}" for s in sides.values()) + " |"
    )
    lines.append(
        "| fast GPUs (1,333 images/s) fed at 70% | "
        + " | ".join(f"{0.7e6 / s['total'].us / 1333:.1f}" for s in sides.values())
        + " |"
    )
    if any(s["shard_phases"] for s in sides.values()):
        lines.append(
            "| the shards: µs, commands an image | "
            + " | ".join(
                f"{sum(c.us for c in s['shard_phases'].values()):.0f}, "
                f"{sum(c.commands for c in s['shard_phases'].values()):.1f}"
                for s in sides.values()
            )
            + " |"
        )
    lines.append(
        "| idle (taken out of each step): µs, commands, instructions a second | "
        + " | ".join(
            f"{s['idle_per_s'].us:.0f}, {s['idle_per_s'].commands:.0f}, {s['idle_per_s'].instructions or 0:,.0f}"
            for s in sides.values()
        )
        + " |"
    )
    lines.append("| jobs ended | " + " | ".join(str(s["ended"]) for s in sides.values()) + " |")
    if any(s.get("cache_entries") is not None for s in sides.values()):
        lines.append(
            "| entries on the cache Redis | " + " | ".join(str(s.get("cache_entries")) for s in sides.values()) + " |"
        )
    lines.append(
        "| an ended record: bytes (MEMORY USAGE), encoding | "
        + " | ".join(f"{s['record']['bytes']:,.0f}, {'/'.join(s['record']['encodings'])}" for s in sides.values())
        + " |"
    )
    for name, side in sides.items():
        lines += ["", f"**{name}**, per step: command calls (µs in it, a script's including its calls') an image", ""]
        for phase in (*PHASES, *APART):
            top = list({**side["phases"], **side["apart"]}[phase].by_command.items())[:12]
            lines.append(
                f"- {phase} ({side['seconds'][phase]:.1f} s): "
                + ", ".join(f"{n} {calls:.2f} ({us:.1f})" for n, (calls, us) in top)
            )
    return "\n".join(lines)


def _round_trips(sides: dict[str, dict[str, Any]]) -> list[str]:
    """Round trips an image, step by step: to the control plane (in all, and by process) and to the shards,
    counted at the processes' connections (a pipeline or MULTI block one; less the idle rate, as above)."""
    names = list(sides)
    lines = [
        "",
        "Round trips an image (counted at each process's Redis connections: a command, or a pipeline or MULTI block "
        "sent whole, is one):",
        "",
        "| step | " + " | ".join(f"{n}: control plane | {n}: by process | {n}: shards" for n in names) + " |",
        "|---|" + "---|---|---|" * len(names),
    ]
    for phase in (*PHASES, "total"):
        cells = []
        for side in sides.values():
            cost = side["total"] if phase == "total" else side["phases"][phase]
            shard = _shard_trips(side, phase)
            by_role = ", ".join(f"{role} {n:.2f}" for role, n in cost.round_trips.items() if abs(n) >= 0.005)
            cells += [f"{cost.trips:.2f}", by_role or "-", f"{shard:.2f}" if side["shard_phases"] else "-"]
        lines.append(f"| {'**all**' if phase == 'total' else phase} | " + " | ".join(cells) + " |")
    return lines


def _cache_apart(sides: dict[str, dict[str, Any]]) -> list[str]:
    """--cache-redis: the cache's own Redis an image, step by step, beside the control plane's (and the ratio of the
    control plane's instructions to the first side's)."""
    if not any(side.get("cache_phases") for side in sides.values()):
        return []
    first = next(iter(sides.values()))["total"].instructions
    lines = [
        "",
        "The result cache's own Redis an image (--cache-redis; less its own idle, as the control plane's), beside "
        "the control plane's:",
        "",
        "| side | step | cache Redis: µs, commands, round trips, instructions "
        "| control plane: instructions (x first side) |",
        "|---|---|---|---|",
    ]
    for name, side in sides.items():
        for phase in (*PHASES, "total"):
            costs = side.get("cache_phases") or {}
            if phase == "total":
                cache = [costs[p] for p in PHASES if p in costs]
                us, commands = sum(c.us for c in cache), sum(c.commands for c in cache)
                trips = sum(c.trips for c in cache)
                counted = [c.instructions for c in cache if c.instructions is not None]
                instructions = sum(counted) if counted else None
            elif phase in costs:
                c = costs[phase]
                us, commands, trips, instructions = c.us, c.commands, c.trips, c.instructions
            else:
                us = commands = trips = 0.0
                instructions = None
            plane = (side["total"] if phase == "total" else side["phases"][phase]).instructions
            ratio = f" ({plane / first:.2f}x)" if phase == "total" and plane and first else ""
            cells = f"{us:.0f}, {commands:.2f}, {trips:.2f}, " + (f"{instructions:,.0f}" if instructions else "-")
            lines.append(f"| {name} | {phase} | {cells} | " + (f"{plane:,.0f}{ratio}" if plane else "-") + " |")
    return lines


def _shard_trips(side: dict[str, Any], phase: str) -> float:
    if phase == "total":
        return sum(_shard_trips(side, p) for p in PHASES)
    cost = side["shard_phases"].get(phase)
    return cost.trips if cost else 0.0


def _apart(sides: dict[str, dict[str, Any]]) -> list[str]:
    """The costs left out of an image's figures, each on its own row."""
    names = list(sides)
    lines = [
        "",
        "Reported apart (not in the figures above): the first submissions, while the deadline index is a listpack, "
        "an image; the first answers, while the result cache's LRU index is one, an image; the CPU worker's start "
        "(its connections, kombu's bindings and scripts, Celery's events, the library check, until its consumer "
        "waits in BRPOP), in all, its job queues parked meanwhile; the GPU worker's start (its SCAN for frame lists "
        "nobody reads, the requeue, the epoch), in all, its frames parked meanwhile:",
        "",
        "| apart | " + " | ".join(f"{n}: µs, commands, round trips, instructions" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for phase in APART:
        cells = []
        for side in sides.values():
            cost = side["apart"][phase]
            instructions = f"{cost.instructions:,.0f}" if cost.instructions is not None else "-"
            cells.append(f"{cost.us:,.0f}, {cost.commands:,.1f}, {cost.trips:,.2f}, {instructions}")
        first = next(iter(sides.values()))["set_apart"]
        label = {
            "intake-listpack": f"intake, the first {first} submissions (an image)",
            "gpu-listpack": f"gpu, the first {first} answers (an image)",
            "cpu-start": "the CPU worker's start (in all, once)",
        }.get(phase, "the GPU worker's start (in all, once)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


STEPS = (*PHASES, "total")
MEASURES = {"us": "main-thread µs", "instructions": "instructions"}


def _figure(side: dict[str, Any], step: str, measure: str) -> float | None:
    cost = side["total"] if step == "total" else side["phases"][step]
    value = getattr(cost, measure)
    return None if value is None else float(value)


def round_medians(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """`--rounds`: per measure (main-thread µs; instructions, when counted), per step and in all, each side's median
    over the rounds and, with two sides (the base first), the median of the rounds' ratios (this checkout / base):
    each ratio is of two runs under the same stretch of the machine's drift."""
    names = list(rounds[0])
    medians: dict[str, Any] = {}
    for measure in MEASURES:
        if any(_figure(side, "total", measure) is None for sides in rounds for side in sides.values()):
            continue
        by_step: dict[str, Any] = {}
        for step in STEPS:
            figures = {name: [_figure(sides[name], step, measure) or 0.0 for sides in rounds] for name in names}
            entry: dict[str, Any] = {name: median(values) for name, values in figures.items()}
            if len(names) == 2:
                base, head = figures[names[0]], figures[names[1]]
                ratios = [h / b if b else float("nan") for b, h in zip(base, head)]
                entry["ratios"], entry["ratio"] = ratios, median(ratios)
            by_step[step] = entry
        medians[measure] = by_step
    return medians


def rounds_report(rounds: list[dict[str, dict[str, Any]]]) -> str:
    """`--rounds`: each round's per-step figures, side by side, then each side's median over the rounds and the
    median of the rounds' ratios."""
    names = list(rounds[0])
    medians = round_medians(rounds)
    lines = [
        "",
        f"## {len(rounds)} rounds, the sides alternating ({', '.join(names)}, and again)",
    ]
    for measure, by_step in medians.items():
        ratio = len(names) == 2
        lines += [
            "",
            f"{MEASURES[measure]} an image, round by round ({' / '.join(names)}"
            + (", and the ratio" if ratio else "")
            + "), and the medians:",
            "",
            "| step | "
            + " | ".join(f"round {index + 1}" for index in range(len(rounds)))
            + " | "
            + " | ".join(f"median: {name}" for name in names)
            + (" | median of the ratios |" if ratio else " |"),
            "|---|" + "---|" * (len(rounds) + len(names) + ratio),
        ]
        for step in STEPS:
            cells = []
            for index, sides in enumerate(rounds):
                figures = " / ".join(_number(_figure(sides[name], step, measure)) for name in names)
                cells.append(figures + (f" ({by_step[step]['ratios'][index]:.3f}x)" if ratio else ""))
            cells += [_number(by_step[step][name]) for name in names]
            if ratio:
                cells.append(f"{by_step[step]['ratio']:.3f}x")
            lines.append(f"| {'**all**' if step == 'total' else step} | " + " | ".join(cells) + " |")
    lines += ["", "Commands an image, round by round (" + " / ".join(names) + "):", ""]
    lines += ["| step | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " |"]
    lines += ["|---|" + "---|" * len(rounds)]
    for step in STEPS:
        cells = [" / ".join(f"{_figure(sides[name], step, 'commands') or 0:.1f}" for name in names) for sides in rounds]
        lines.append(f"| {'**all**' if step == 'total' else step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounds_summary(rounds: list[dict[str, dict[str, Any]]]) -> str:
    """One line a measure: in all, an image, each side's median over the rounds, the median of the rounds' ratios,
    and each round's ratio."""
    names = list(rounds[0])
    lines = []
    for measure, by_step in round_medians(rounds).items():
        total = by_step["total"]
        sides = ", ".join(
            f"{'base' if len(names) == 2 and index == 0 else name} {_number(total[name])}"
            for index, name in enumerate(names)
        )
        line = f"{MEASURES[measure]} an image, median of {len(rounds)} rounds: {sides}"
        if "ratio" in total:
            line += f", ratio {total['ratio']:.3f} (rounds: {', '.join(f'{r:.3f}' for r in total['ratios'])})"
        lines.append(line)
    return "\n".join(lines)


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 10 else f"{value:.1f}"
