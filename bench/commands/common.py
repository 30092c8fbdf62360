"""What the bench's command groups share: the parent parsers, the local stacks' options, the report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.load import charts, client
from bench.load.report import markdown
from bench.stack.local import StackOptions
from bench.stack.profiles import parse_profile


def parse_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as YAML (true, 16, fp16, [1, 2])."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)


def parse_list(kind):
    return lambda text: [kind(part) for part in text.split(",") if part]


def common_parser() -> argparse.ArgumentParser:
    """The corpus, the loads and where reports go: for every command that sends images."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--corpus", type=Path, help="a folder of images (default: generated 1080p JPEGs)")
    common.add_argument("--images", type=int, default=24, help="how many images to generate")
    common.add_argument("--out", type=Path, default=Path(".bench") / "results")
    common.add_argument("--closed", type=parse_list(int), default=[1, 8, 32], help="closed-loop concurrencies")
    common.add_argument("--closed-duration", type=float, default=20.0)
    common.add_argument("--open-qps", type=parse_list(float), default=[18.0], help="open-loop rates")
    common.add_argument("--open-duration", type=float, default=60.0)
    common.add_argument(
        "--repeat-share",
        type=parse_list(float),
        default=[0.0],
        help="closed loops: the share of requests that repeat an earlier image (e.g. 0,0.5,0.9: "
        "each level at each share); the result cache answers repeats",
    )
    common.add_argument(
        "--calls",
        type=parse_list(str),
        default=["two"],
        help="two: submit, then long-poll (the default); one: POST /v1/jobs?wait=30 answers the "
        "finished job; one,two: both, in turn",
    )
    common.add_argument(
        "--upload",
        choices=client.UPLOADS,
        default="raw",
        help="raw: the image as the body (Content-Type: image/jpeg); multipart: a form field (curl -F)",
    )
    return common


def local_parser() -> argparse.ArgumentParser:
    """The stacks the bench starts here: device, pools, batching, Redis's options, shards, the sim profile."""
    local = argparse.ArgumentParser(add_help=False)
    local.add_argument("--device", default="sim", help="sim | cpu | cuda (for the stacks the bench starts)")
    local.add_argument(
        "--cpu-workers",
        type=int,
        default=None,
        help="CPU worker pool size (default 2; with --stack local, the Procfile's: 3)",
    )
    local.add_argument("--max-batch", type=int, default=8)
    local.add_argument("--window-ms", type=float, default=12.0)
    local.add_argument(
        "--redis-args",
        default="",
        help="more options for the stacks' redis-server, e.g. '--io-threads 2 --io-threads-do-reads yes'",
    )
    local.add_argument(
        "--shards",
        type=int,
        default=0,
        help="bulk shards: uploads and frames on this many more redis-servers (bulk.redis_urls), "
        "each one's CPU per image reported (default 0: all in the one Redis)",
    )
    local.add_argument(
        "--profile",
        help="device sim: the latency profile of the stacks started here (fast, story "
        "or 1:2,8:6,16:10 ms per batch size; default: the config's, story)",
    )

    return local


def stack_options(args: argparse.Namespace, **overrides: Any) -> StackOptions:
    values = dict(
        device=args.device,
        cpu_workers=args.cpu_workers or 2,
        max_batch_size=args.max_batch,
        window_ms=args.window_ms,
        sim_profile_ms=parse_profile(args.profile) if args.profile else None,
        redis_args=tuple(args.redis_args.split()),
        bulk_shards=args.shards,
    )
    return StackOptions(**{**values, **overrides})


def write_report(results: list[dict[str, Any]], out: Path, title: str, extra: dict | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results, title)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{stamp}-report.md").write_text(text + "\n")
    (out / f"{stamp}-report.json").write_text(
        json.dumps({"title": title, "results": results, **(extra or {})}, indent=2)
    )
    made = [
        charts.concurrency_chart(results, out / f"{stamp}-concurrency.png"),
        charts.time_bill_chart(results, out / f"{stamp}-time-bill.png"),
    ]
    return text + "\n\nFiles: " + ", ".join(str(p) for p in [out / f"{stamp}-report.json", *made] if p)


def print_report(outcome: dict[str, Any], out: Path) -> int:
    """A load command's outcome: its report written and printed, then its summary and table lines."""
    results, title = outcome.pop("results"), outcome.pop("title")
    print(write_report(results, out, title, outcome))
    for line in (outcome.get("summary"), outcome.get("table")):
        if line:
            print("\n" + line)
    return 0


def log_line(line: str) -> None:
    """A command's progress, on stderr (the report goes to stdout)."""
    print(f"  {line}", file=sys.stderr)


def write_files(out: Path, name: str, text: str, data: Any) -> Path:
    """A command's Markdown and JSON under `out`, stamped; the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{stamp}-{name}.md").write_text(text + "\n")
    (out / f"{stamp}-{name}.json").write_text(json.dumps(data, indent=2))
    return out / f"{stamp}-{name}.json"
