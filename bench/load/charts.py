"""PNG charts drawn with Pillow itself (matplotlib would pull plain Pillow over
Pillow-SIMD): throughput and p95 against concurrency, and the time bill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

STAGE_COLOURS = {
    "receive": (120, 120, 120),
    "queue_cpu": (240, 170, 60),
    "decode": (220, 90, 60),
    "resize": (200, 60, 120),
    "backpressure": (175, 175, 175),
    "queue_gpu": (150, 100, 200),
    "batch_wait": (90, 140, 230),
    "device_queue": (60, 90, 160),
    "infer": (40, 170, 90),
    "postprocess": (30, 160, 170),
}
SERIES = [(40, 110, 220), (230, 90, 40), (40, 170, 90), (150, 80, 200)]
FONT = ImageFont.load_default()


def concurrency_chart(results: list[dict[str, Any]], path: Path) -> Path | None:
    closed = [r for r in results if r["mode"] == "closed"]
    if not closed:
        return None
    levels = sorted({r["concurrency"] for r in closed})
    names = list(dict.fromkeys(r["name"] for r in closed))
    image = Image.new("RGB", (1000, 420), "white")
    draw = ImageDraw.Draw(image)
    panels = (("achieved QPS", lambda r: r["achieved_qps"]), ("p95 latency (ms)", lambda r: r["latency_ms"]["p95"]))
    for p, (label, value) in enumerate(panels):
        left, top, width, height = 70 + p * 480, 50, 400, 300
        points = {
            n: [(r["concurrency"], value(r)) for r in closed if r["name"] == n and value(r) is not None] for n in names
        }
        top_value = max([v for pts in points.values() for _, v in pts] + [1.0]) * 1.15
        draw.rectangle((left, top, left + width, top + height), outline=(0, 0, 0))
        draw.text((left, top - 20), label, fill=(0, 0, 0), font=FONT)
        for k in range(5):
            y = top + height - height * k / 4
            draw.text((left - 60, y - 6), f"{top_value * k / 4:.1f}", fill=(80, 80, 80), font=FONT)
        xs = {c: left + width * (i + 0.5) / len(levels) for i, c in enumerate(levels)}
        for c, x in xs.items():
            draw.text((x - 10, top + height + 8), f"c={c}", fill=(0, 0, 0), font=FONT)
        for s, name in enumerate(names):
            colour = SERIES[s % len(SERIES)]
            coords = [(xs[c], top + height - height * v / top_value) for c, v in sorted(points[name])]
            if len(coords) > 1:
                draw.line(coords, fill=colour, width=3)
            for x, y in coords:
                draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)
    for s, name in enumerate(names):
        draw.rectangle((70 + s * 200, 390, 84 + s * 200, 404), fill=SERIES[s % len(SERIES)])
        draw.text((90 + s * 200, 391), name, fill=(0, 0, 0), font=FONT)
    image.save(path)
    return path


def time_bill_chart(results: list[dict[str, Any]], path: Path) -> Path | None:
    rows = [r for r in results if r["time_bill_ms"]]
    if not rows:
        return None
    height = 80 + 34 * len(rows) + 40
    image = Image.new("RGB", (1000, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((20, 15), "Time bill: mean ms per stage (where a request's time goes)", fill=(0, 0, 0), font=FONT)
    longest = max(sum(v["mean"] for s, v in r["time_bill_ms"].items() if s in STAGE_COLOURS) for r in rows) or 1
    scale = 700 / longest
    for i, r in enumerate(rows):
        y = 50 + 34 * i
        label = f"{r['name']} {r['mode']} " + (
            f"c={r['concurrency']}" if r["concurrency"] else f"{r['offered_qps']:g} qps"
        )
        draw.text((10, y + 6), label[:32], fill=(0, 0, 0), font=FONT)
        x = 240
        for stage, colour in STAGE_COLOURS.items():
            width = r["time_bill_ms"].get(stage, {}).get("mean", 0.0) * scale
            if width > 0:
                draw.rectangle((x, y, x + width, y + 24), fill=colour)
                x += width
        draw.text(
            (x + 6, y + 6), f"{r['time_bill_ms'].get('total', {}).get('mean', 0):.0f} ms", fill=(0, 0, 0), font=FONT
        )
    x = 20
    for stage, colour in STAGE_COLOURS.items():
        draw.rectangle((x, height - 30, x + 12, height - 18), fill=colour)
        draw.text((x + 16, height - 30), stage, fill=(0, 0, 0), font=FONT)
        x += 120
    image.save(path)
    return path
