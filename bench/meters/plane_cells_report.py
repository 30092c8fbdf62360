"""`bench plane --cells`' arithmetic and report: the deployment's ceiling at the split measured, the verdict of
docs/cells.md's targets, and what each cell's Redis main thread did an image (`MainThread`): its CPU split user
and system, the time its commands ran, its context switches. Those say whether a cell that costs more µs than
one cell does more work (more commands, more time in them at the same instructions) or is priced more by the
machine (more system time and wake-ups a command, preemptions)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.meters.plane import PHASES

CELL_NAMES = "abcdefghijklmnop"
CORE_SHARE = 0.7  # each cell's Redis core kept at 70% at the ceiling, as bench plane's
DETAIL = ("user_us", "sys_us", "in_commands_us", "voluntary", "involuntary")


@dataclass(frozen=True)
class MainThread:
    """A Redis main thread at one moment: its CPU, user and system (its INFO), the µs its commands ran (its
    commandstats' usec, summed) and the kernel's count of its context switches: voluntary (it slept waiting for
    work, one a wake-up) and involuntary (preempted while runnable)."""

    user_us: float
    sys_us: float
    in_commands_us: float
    voluntary: int
    involuntary: int

    @classmethod
    def of(cls, client: redis.Redis, pid: int) -> MainThread:
        cpu: dict[str, Any] = client.info("cpu")
        stats: dict[str, Any] = client.info("commandstats")
        lines = Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines()
        status = dict(line.split(":", 1) for line in lines if ":" in line)
        return cls(
            float(cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"])) * 1e6,
            float(cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])) * 1e6,
            float(sum(int(v["usec"]) for name, v in stats.items() if name != "cmdstat_info")),
            int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]),
        )


def per_image(pairs: list[tuple[MainThread, MainThread]], images: int) -> dict[str, float]:
    """What the main thread did over the phases (before, after each), per image."""
    return {
        name: sum(getattr(after, name) - getattr(before, name) for before, after in pairs) / max(images, 1)
        for name in DETAIL
    }


def ceiling(side: dict[str, Any], cost: str = "us") -> float:
    """Images/s the deployment takes when its busiest cell's Redis reaches 70% of a core, at the split measured
    (`cost` "instructions": in images per 1e6 instructions, for ratios only)."""
    total = sum(cell["images"] for cell in side["per_cell"])
    return min(
        CORE_SHARE * 1e6 / getattr(cell["total"], cost) / (cell["images"] / total)
        for cell in side["per_cell"]
        if cell["images"]
    )


def verdict(one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """The targets of docs/cells.md: ceiling >= 1.8x one cell's; each cell's µs and commands an image within 1.1x
    of one cell's; the images split within 10% of an even share. Where instructions were counted (callgrind: the
    µs are valgrind's), the ceiling's ratio and the cost's are the instructions'."""
    base = one["per_cell"][0]["total"]
    cost = "instructions" if base.instructions is not None else "us"
    ratio = ceiling(many, cost) / ceiling(one, cost)
    cost_ratios = [getattr(cell["total"], cost) / getattr(base, cost) for cell in many["per_cell"]]
    command_ratios = [cell["total"].commands / base.commands for cell in many["per_cell"]]
    even = many["images"] / many["cells"]
    split = max(abs(cell["images"] - even) / even for cell in many["per_cell"])
    return {
        "cost": cost,
        "ceiling_ratio": ratio,
        "cost_ratios": cost_ratios,
        "command_ratios": command_ratios,
        "split_off_even": split,
        "met": ratio >= 1.8 and max(cost_ratios) <= 1.1 and max(command_ratios) <= 1.1 and split <= 0.10,
    }


def report(one: dict[str, Any], many: dict[str, Any]) -> str:
    found = verdict(one, many)
    rows = [("1 cell", one["per_cell"][0])]
    rows += [(f"{many['cells']} cells: {CELL_NAMES[i]}", c) for i, c in enumerate(many["per_cell"])]
    lines = [
        f"## The control plane over cells (`bench plane --cells {many['cells']}`: each cell's Redis, its own INFO)",
        "",
        f"{one['images']} images of 640x16 a cell; one API; each cell its own redis-server, bulk shard(s), CPU "
        "worker and GPU worker (sim). µs: the cell's Redis main-thread CPU an image it took, less its idle rate.",
        "",
        "| cell | images | "
        + " | ".join(f"{p}: µs, commands" for p in PHASES)
        + " | **all**: µs, commands | **all**: instructions |",
        "|---|---|" + "---|" * (len(PHASES) + 2),
    ]
    for name, cell in rows:
        phases = " | ".join(f"{cell['phases'][p].us:.0f}, {cell['phases'][p].commands:.1f}" for p in PHASES)
        total = cell["total"]
        counted = f"{total.instructions:,.0f}" if total.instructions is not None else "-"
        lines.append(f"| {name} | {cell['images']} | {phases} | {total.us:.0f}, {total.commands:.1f} | {counted} |")
    lines += [
        "",
        "| ceiling (each cell's core at 70%) | 1 cell | " + f"{many['cells']} cells |",
        "|---|---|---|",
        f"| images/s | {ceiling(one):,.0f} | {ceiling(many):,.0f} |",
        f"| fast GPUs (1,333 images/s) fed | {ceiling(one) / 1333:.1f} | {ceiling(many) / 1333:.1f} |",
        f"| jobs ended | {one['ended']} | {many['ended']} |",
        "",
        f"- ceiling {found['ceiling_ratio']:.2f}x one cell's, by {found['cost']} an image (target >= 1.8x)",
        f"- each cell's {found['cost']} an image / one cell's: " + ", ".join(f"{r:.2f}x" for r in found["cost_ratios"]),
        "- each cell's commands an image / one cell's: " + ", ".join(f"{r:.2f}x" for r in found["command_ratios"]),
        f"- the split: the farthest cell {found['split_off_even']:.1%} off an even share (target within 10%)",
        f"- targets {'met' if found['met'] else 'NOT met'}",
    ]
    if found["cost"] == "instructions":
        lines.append("- (under callgrind the µs and images/s above are valgrind's: the ratios are the instructions')")
    return "\n".join(lines + ["", *main_thread_table(rows), "", *command_table(rows)])


def main_thread_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each cell's main thread an image over the four phases (idle not taken out): where its µs went."""
    lines = [
        "Each cell's Redis main thread an image, the four phases (idle included): CPU user and system µs, the µs "
        "its commands ran (commandstats), wake-ups (voluntary switches) and preemptions (involuntary).",
        "",
        "| cell | user µs | system µs | in commands µs | wake-ups | preemptions |",
        "|---|---|---|---|---|---|",
    ]
    for name, cell in rows:
        if "main_thread" in cell:
            d = cell["main_thread"]
            lines.append(
                f"| {name} | {d['user_us']:.0f} | {d['sys_us']:.0f} | {d['in_commands_us']:.0f} "
                f"| {d['voluntary']:.2f} | {d['involuntary']:.3f} |"
            )
    return lines


def command_table(rows: list[tuple[str, dict[str, Any]]], top: int = 6) -> list[str]:
    """The commands one cell spends most in: calls an image and µs a call in each cell. The same command at the
    same calls and instructions taking more µs a call is the machine's price, not more work."""
    base = rows[0][1]["total"].by_command
    names = sorted(base, key=lambda name: -base[name][1])[:top]
    lines = [
        "| command | " + " | ".join(f"{name}: calls, µs a call" for name, _ in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for command in names:
        cells = []
        for _, cell in rows:
            calls, us = cell["total"].by_command.get(command, (0.0, 0.0))
            cells.append(f"{calls:.2f}, {us / calls:.2f}" if calls else "-")
        lines.append(f"| {command} | " + " | ".join(cells) + " |")
    return lines
