"""imgserve: submit images, read and cancel jobs from the shell.

    imgserve submit street.jpg photos/ --wait          # a folder: every image in it
    imgserve submit street.jpg --draw boxes/           # and write each image with its boxes drawn (Pillow)
    imgserve status <job-id> [--wait 10]
    imgserve cancel <job-id>
    imgserve models

--url (or IMGSERVE_URL) names the API (default http://localhost:8000); --api-key (or IMGSERVE_API_KEY) a key.
A request refused as busy (429, 503) is sent again after its Retry-After: --retries times at most, its waits
--retry-wait seconds in all at most (--retries 0: never). `submit` goes on past a file that is still refused
then, and says at the end which were not submitted.
Exit status: 0 done; 1 the API answered with an error, or a job did not succeed; 2 a usage error;
3 the API could not be reached. Either way the URL it talked to is named, and where that came from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import requests

from imgserve_client import RETRIES, RETRY_WAIT_S, AnswerTooLarge, AnswerTooSlow, ApiError, Client, printable
from imgserve_client.draw import DrawingUnavailable

UNREACHABLE = 3
BROKEN_PIPE = 141  # what a tool killed by SIGPIPE ends with: `imgserve models | head` read what it wanted

DEFAULT_URL = "http://localhost:8000"
URL_ENV = "IMGSERVE_URL"

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


def expand(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        else:
            files.append(path)
    return files


def detections_table(path: Path, doc: dict) -> list[str]:
    if doc["status"] != "succeeded":
        error = doc.get("error") or {}
        said = f"{doc['status']} {error.get('code', '')} {error.get('message', '')}"
        return [f"{path}: {printable(said)}".rstrip()]
    image = doc["result"]["image"]
    # A result-cache hit took no decode and no GPU: its "0 ms" says so in words.
    hit = "cache hit, " if doc.get("cache") == "hit" else ""
    lines = [
        f"{path}: {len(doc['result']['detections'])} detections in "
        f"{number(image['width'], 'd')}x{number(image['height'], 'd')} "
        f"({hit}{number(doc['timings_ms'].get('total', 0), '.0f')} ms)"
    ]
    lines.append(f"  {'label':<12} {'score':>6}  box (x1, y1, x2, y2)")
    for d in doc["result"]["detections"]:
        box = ", ".join(number(v, ".0f") for v in d["box"])
        lines.append(f"  {printable(d['label']):<12} {number(d['score'], '>6.3f')}  {box}")
    return lines


def number(value: object, spec: str) -> str:
    """A figure the server sent, formatted when it is one; anything else (a string, escape sequences and all)
    reaches the terminal escaped instead of as a command to it or a traceback."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return printable(value)
    return format(value, spec) if spec != "d" or isinstance(value, int) else printable(value)


def draw_to(path: Path, doc: dict, out: Path, single: bool) -> Path:
    """`--draw OUT`: the file OUT for a single image given one with an image suffix, else OUT/<name>."""
    from imgserve_client.draw import draw_detections

    target = out if single and out.suffix.lower() in IMAGE_SUFFIXES else out / path.name
    return draw_detections(path, doc, target)


# Per-request options: `model` is a name (routed as the deployment says) or name:version (pinned).
OPTIONS = (("model", str), ("conf", float), ("iou", float), ("max_det", int), ("deadline_ms", int))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imgserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help=f"the API (default: IMGSERVE_URL, else {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get("IMGSERVE_API_KEY"))
    parser.add_argument(
        "--retries",
        type=int,
        default=RETRIES,
        help=f"send a request refused as busy (429, 503) again this often at most, after its Retry-After "
        f"(default {RETRIES}; 0: never)",
    )
    parser.add_argument(
        "--retry-wait",
        type=float,
        default=RETRY_WAIT_S,
        metavar="SECONDS",
        help=f"wait at most this long in all for one request's retries (default {RETRY_WAIT_S:g})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    submit = sub.add_parser("submit", help="submit images (files or folders)")
    submit.add_argument("paths", nargs="+")
    submit.add_argument("--wait", action="store_true", help="wait and print the detections")
    submit.add_argument("--concurrency", type=int, default=8)
    submit.add_argument(
        "--draw",
        metavar="OUT",
        type=Path,
        help="wait, then write each image with its boxes and labels drawn: into the folder OUT "
        "(same file names), or to the file OUT for a single image (.jpg, .png); needs Pillow",
    )
    for option, kind in OPTIONS:
        submit.add_argument(f"--{option.replace('_', '-')}", dest=option, type=kind)
    status = sub.add_parser("status", help="a job's state")
    status.add_argument("job_id")
    status.add_argument("--wait", type=float, default=0.0, help="long-poll up to this many seconds")
    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id")
    sub.add_parser("models", help="the models being served")
    return parser


class Unreachable(Exception):
    """The API did not answer at all: said in one line, not as a traceback."""


def api_url(flag: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, str]:
    """The API's URL and where it came from, as the messages say it: --url, IMGSERVE_URL, or the default."""
    if flag:
        return flag, "given by --url"
    if environ.get(URL_ENV):
        return environ[URL_ENV], f"from {URL_ENV}"
    return DEFAULT_URL, f"the default (neither --url nor {URL_ENV} set)"


ANOTHER = f"--url URL or {URL_ENV}=URL names another"


def talked_to(url: str, source: str) -> str:
    """Which API a message is about, where its URL came from, and how to name another."""
    return f"the API at {url}, {source}; {ANOTHER}"


def unreachable(url: str, source: str, exc: BaseException) -> Unreachable:
    text = str(exc)
    if isinstance(exc, requests.Timeout):
        why = "no answer in time"
    elif "Connection refused" in text:
        why = "connection refused"
    elif "Name or service not known" in text or "Failed to resolve" in text or "nodename nor servname" in text:
        why = "unknown host"
    else:
        why = type(exc).__name__
    return Unreachable(
        f"imgserve: cannot reach the API at {url} ({why}), {source}; is it running? "
        f"(`make run` starts one at {DEFAULT_URL}; {ANOTHER})"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.url, args.url_source = api_url(args.url)
    client = Client(args.url, api_key=args.api_key, retries=args.retries, retry_wait_s=args.retry_wait)
    try:
        return run(args, client)
    except ApiError as exc:
        print(f"error: {exc}\n  ({talked_to(args.url, args.url_source)})", file=sys.stderr)
        return 1
    except DrawingUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (AnswerTooLarge, AnswerTooSlow) as exc:  # it answered, but not as an API does
        print(f"error: {printable(exc)}\n  ({talked_to(args.url, args.url_source)})", file=sys.stderr)
        return 1
    except requests.RequestException as exc:
        print(unreachable(args.url, args.url_source, exc), file=sys.stderr)
        return UNREACHABLE
    except Unreachable as exc:
        print(exc, file=sys.stderr)
        return UNREACHABLE
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say, and nothing to say it to. Python would flush
        # stdout again at exit and print a second traceback for it: stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


def run(args: argparse.Namespace, client: Client) -> int:
    if args.command == "submit":
        options = {option: getattr(args, option) for option, _ in OPTIONS}
        files = expand(args.paths)
        if args.draw is not None and not args.wait:
            args.wait = True  # drawing needs the answer
        if not args.wait:
            return submit_each(args, client, files, options)
        failed = refused = 0
        for path, doc in client.submit_many(files, concurrency=args.concurrency, **options):
            if doc["status"] == "error" and doc["error"]["code"] in ("ConnectionError", "ConnectTimeout"):
                # every image would say it
                raise unreachable(args.url, args.url_source, ConnectionError(doc["error"]["message"]))
            print("\n".join(detections_table(path, doc)))
            failed += doc["status"] != "succeeded"
            refused += doc["status"] == "error" and doc["error"]["code"] == "ApiError"
            if args.draw is not None and doc["status"] == "succeeded":
                print(f"  drawn: {draw_to(path, doc, args.draw, single=len(files) == 1)}")
        say_retried(client)
        if refused:
            print(f"imgserve: {refused} refused by {talked_to(args.url, args.url_source)}", file=sys.stderr)
        return 1 if failed else 0
    if args.command == "status":
        print(json.dumps(client.status(args.job_id, wait_s=args.wait), indent=2))
    elif args.command == "cancel":
        print(json.dumps(client.cancel(args.job_id), indent=2))
    elif args.command == "models":
        print(json.dumps(client.models(), indent=2))
    return 0


def submit_each(args: argparse.Namespace, client: Client, files: list[Path], options: dict) -> int:
    """Submit every file, one after another, printing each one's job id: a file the API still refuses after its
    retries is said at once and the rest go on; exit 1 at the end if any was not submitted."""
    refused: list[Path] = []
    for path in files:
        try:
            job_id = client.submit(path, **options)["id"]
        except ApiError as exc:
            print(f"error: {exc} [{path}]", file=sys.stderr)
            refused.append(path)
            continue
        print(f"{path}\t{printable(job_id)}", flush=True)
    say_retried(client)
    if not refused:
        return 0
    if len(files) > 1:
        print(f"imgserve: {len(refused)} of {len(files)} files not submitted", file=sys.stderr)
    print(f"  ({talked_to(args.url, args.url_source)})", file=sys.stderr)
    return 1


def say_retried(client: Client) -> None:
    if client.retried:
        print(f"imgserve: {client.retried} refusals (busy) sent again after their Retry-After", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
