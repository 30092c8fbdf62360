"""A value's walk through the product's files, counted from the code running: `python -m bench.meters.walks`.

The rule (the walks of docs/architecture.md, as a profiler trace reads them): from the moment a step's function is
called with the value, every call into a product file (app/, tasks/, gpu_worker/, contract/) whose arguments or locals
carry the value is a stop, in call order. A local carries it when it is the value (a string equal to it, an object the
same object), or holds it one level down: an item of a tuple or a list, an attribute of an object (a Placement's
reservation, an Asked's job id, a frame's header). A document the value was written into (a dict such as a job record, a
pydantic model such as the answer's JobDocument) is not followed: the walk is the value's way to the store and back, not
what is made of what the store answered (`--documents` follows those too, for comparison). The walk's files are the
distinct files of its stops; a return is a stop in a file the walk had been in and left (A -> B -> A is one). A second
reading, printed beside it and not held, counts the ways back too: each time a callee hands the value back to its caller
in a file left before, up to the walk's last stop (a facade that calls a helper elsewhere for each key pays one a call).
What the value meets outside the product (Redis's client, Flask, the standard library) is not counted, nor is any call
made in another thread.

Six walks are measured, each on a real step against a private Redis: a submission's reservation (`Placement.take`,
the step after its body is read, the API's test client posting an image; and the same reservation's whole life, from
the call that makes it: `follow_from_birth`), a claim's job id (`Preprocessor.run`, the CPU worker's step on a job
the API made), a read's job id (`get_job`), and the claim's two ways to end a job itself: one whose image does not
decode (it ends failed) and one found late (it ends expired). tests/test_walks.py holds each at what
docs/architecture.md says.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import BaseModel

from bench.stack.processes import REPO_ROOT, RedisServer

PRODUCT = ("app", "tasks", "gpu_worker", "contract")
T = TypeVar("T")
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.CodeType)
_WIDEST = 256  # a container larger than this is not looked into (no walk's value hides in one)


@dataclass(frozen=True)
class Stop:
    """One call the value went through: the product file it sits in and its function."""

    file: str
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.function}"


@dataclass
class Walk:
    """A value's stops in call order, from its step's function on."""

    name: str
    stops: list[Stop] = field(default_factory=list)
    way: list[str] = field(default_factory=list)  # with the ways back to a caller (way_of)

    @property
    def files(self) -> list[str]:
        """The distinct files of the stops, in the order the walk first entered them."""
        return list(dict.fromkeys(stop.file for stop in self.stops))

    @property
    def trail(self) -> list[str]:
        """The files in walk order, a run of stops in one file as one entry."""
        trail: list[str] = []
        for stop in self.stops:
            if not trail or trail[-1] != stop.file:
                trail.append(stop.file)
        return trail

    @property
    def returns(self) -> int:
        """How often the walk came back into a file it had been in and left."""
        return len(self.trail) - len(set(self.trail))

    @property
    def returns_to_callers(self) -> int:
        """`returns`, counting also each time a callee gave the value back to its caller in a file left before, up to
        the walk's last stop: a facade that calls a helper elsewhere for each key pays one each."""
        return len(self.way) - len(set(self.way))

    def report(self) -> str:
        lines = [
            f"{self.name}: {len(self.files)} files, {self.returns} returns ({self.returns_to_callers} counting"
            " the ways back to a caller)"
        ]
        lines.append("  trail: " + " -> ".join(self.trail))
        lines += [f"  {stop}" for stop in self.stops]
        return "\n".join(lines)


def carries(local: Any, value: Any, documents: bool = False) -> bool:
    """Whether `local` is `value` or holds it one level down: an attribute of an object, an item of a tuple or a
    list; with `documents`, a value of a dict too (a job record's `id`: see the module's rule)."""
    if _is(local, value):
        return True
    if isinstance(local, _OPAQUE) or isinstance(local, (str, bytes, bytearray, memoryview, int, float)):
        return False
    if isinstance(local, (tuple, list)):
        return len(local) <= _WIDEST and any(_is(item, value) for item in local)
    if isinstance(local, dict):
        return documents and len(local) <= _WIDEST and any(_is(item, value) for item in local.values())
    if isinstance(local, BaseModel) and not documents:
        return False
    attributes = getattr(local, "__dict__", None)
    if isinstance(attributes, dict) and len(attributes) <= _WIDEST:
        if any(_is(item, value) for item in attributes.values()):
            return True
    return any(isinstance(name, str) and _is(getattr(local, name, None), value) for name in _slots(type(local)))


def _slots(kind: type) -> list[str]:
    return [name for klass in kind.__mro__ for name in getattr(klass, "__slots__", ()) if isinstance(name, str)]


def way_of(calls: list[tuple[Stop, bool]], events: list[int]) -> list[str]:
    """The file the value is in, each time it changes, up to the walk's last stop: into a callee that carries it, and
    back to the carrying caller when that callee returns."""
    way: list[str] = []
    last = 0  # the length of `way` at the last stop's entry
    open_files: list[str] = []
    for event in events:
        stop, carried = calls[event if event >= 0 else ~event]
        if not carried:
            continue
        if event >= 0:
            open_files.append(stop.file)
        else:
            open_files.pop()
        if open_files and (not way or way[-1] != open_files[-1]):
            way.append(open_files[-1])
        if event >= 0:
            last = len(way)
    return way[:last]


def _is(local: Any, value: Any) -> bool:
    if local is value:
        return True
    return type(value) is str and type(local) is str and local == value


def _product_file(code: types.CodeType) -> str | None:
    path = Path(code.co_filename)
    try:
        relative = path.resolve().relative_to(REPO_ROOT)
    except ValueError:
        return None
    return str(relative) if relative.parts[0] in PRODUCT else None


def follow(
    name: str, run: Callable[[], T], root: str, pick: Callable[[dict[str, Any]], Any], documents: bool = False
) -> tuple[T, Walk]:
    """`run()` under a profiler; the walk of the value `pick` takes from the arguments of the first call of `root`
    ("<file>:<function>", e.g. "app/jobs.py:get_job"), through that call's extent (`documents`: see carries)."""
    root_file, root_function = root.split(":")
    walk = Walk(name)
    calls: list[tuple[Stop, bool]] = []  # every product call in the root's extent, and whether it carried the value
    events: list[int] = []  # those calls' entries (their place in `calls`) and exits (~place), in order
    frames: list[tuple[types.FrameType, int | None]] = []  # the root's extent: each frame and its place in `calls`
    state: dict[str, Any] = {"value": None, "done": False}

    def profile(frame: types.FrameType, event: str, _arg: Any) -> None:
        if state["done"] or event not in ("call", "return"):
            return
        if event == "call":
            code = frame.f_code
            if not frames:
                if code.co_name != root_function or _product_file(code) != root_file:
                    return
                state["value"] = pick(frame.f_locals)
            file = _product_file(code)
            if file is None:
                frames.append((frame, None))
                return
            carried = any(carries(local, state["value"], documents) for local in frame.f_locals.values())
            calls.append((Stop(file, code.co_qualname), carried))
            frames.append((frame, len(calls) - 1))
            events.append(len(calls) - 1)
            return
        if not frames or frames[-1][0] is not frame:
            return
        _, index = frames.pop()
        if index is not None:
            events.append(~index)
        if index is not None and not calls[index][1]:  # its locals at the end may carry it (one it made)
            if any(carries(local, state["value"], documents) for local in frame.f_locals.values()):
                calls[index] = (calls[index][0], True)
        if not frames:
            state["done"] = True

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(previous)
    if not calls:
        raise RuntimeError(f"{root} was never called: no walk")
    walk.stops = [stop for stop, carried in calls if carried]
    walk.way = way_of(calls, events)
    return result, walk


def follow_from_birth(name: str, run: Callable[[], T], root: str, born: str, documents: bool = False) -> tuple[T, Walk]:
    """`follow`, for a value made inside `root`'s extent: the value the first call of `born` ("<file>:<function>")
    returns, from that return on. A call is a stop from the moment it holds the value: entered with it, handed it
    back by a callee (the callee's return carries it), or holding it at its end; the stops are in that order, and
    the ways back count from the same moments. Calls before the value was made carry nothing."""
    tracer = _FromBirth(root, born, documents)
    previous = sys.getprofile()
    sys.setprofile(tracer.profile)
    try:
        result = run()
    finally:
        sys.setprofile(previous)
    if not tracer.made:
        raise RuntimeError(f"{born} was never called inside {root}: no walk")
    order = sorted((moment, index) for index, moment in enumerate(tracer.since) if moment >= 0)
    walk = Walk(name, [tracer.calls[index][0] for _, index in order])
    walk.way = way_of(tracer.calls, tracer.events)
    return result, walk


class _FromBirth:
    """follow_from_birth's profiler: the calls in the root's extent, and when each began to hold the value."""

    def __init__(self, root: str, born: str, documents: bool) -> None:
        self.root, self.born, self.documents = tuple(root.split(":")), tuple(born.split(":")), documents
        self.calls: list[tuple[Stop, bool]] = []
        self.since: list[int] = []  # each call's moment (its place in `events`) from which it held the value
        self.events: list[int] = []  # a call's first holding (its place in `calls`), and then its exit (~place)
        self.frames: list[tuple[types.FrameType, int | None]] = []
        self.value: Any = None
        self.made = self.done = False

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self.done or event not in ("call", "return"):
            return
        if event == "call":
            self._called(frame)
            return
        if not self.frames or self.frames[-1][0] is not frame:
            return
        _, index = self.frames.pop()
        if index is not None:
            self._returned(index, frame, arg)
        self.done = not self.frames

    def _holds(self, index: int) -> None:
        self.calls[index] = (self.calls[index][0], True)
        self.since[index] = len(self.events)
        self.events.append(index)

    def _carried(self, local: Any) -> bool:
        return self.made and carries(local, self.value, self.documents)

    def _called(self, frame: types.FrameType) -> None:
        code = frame.f_code
        file = _product_file(code)
        if not self.frames and (file, code.co_name) != self.root:
            return
        if file is None:
            self.frames.append((frame, None))
            return
        self.calls.append((Stop(file, code.co_qualname), False))
        self.since.append(-1)
        self.frames.append((frame, len(self.calls) - 1))
        if any(self._carried(local) for local in frame.f_locals.values()):
            self._holds(len(self.calls) - 1)

    def _returned(self, index: int, frame: types.FrameType, value: Any) -> None:
        stop, held = self.calls[index]
        if not self.made and (stop.file, stop.function.split(".")[-1]) == self.born:
            self.value, self.made = value, True
            self._holds(index)
        elif not held and any(self._carried(local) for local in frame.f_locals.values()):
            self._holds(index)
        if self.calls[index][1]:
            self.events.append(~index)
            caller = self.frames[-1][1] if self.frames else None
            if caller is not None and not self.calls[caller][1] and self._carried(value):
                self._holds(caller)  # handed back to its caller


@contextmanager
def private_api(redis_url: str, namespace: str = "walks") -> Iterator[Any]:
    """The API in this process (Flask's test client: the request runs in this thread) on `redis_url`."""
    from app import create_app
    from contract.settings.config import load_settings

    # as the tests' in-process APIs are made; Settings' dataclass decorator is not one mypy sees through
    settings = dataclasses.replace(cast(Any, load_settings()), redis_url=redis_url, namespace=namespace)
    app = create_app(settings)
    try:
        yield app
    finally:
        from app.services import services

        services(app).cells.close()  # its listeners' threads


def measure(redis_url: str, namespace: str = "walks", documents: bool = False) -> dict[str, Walk]:
    """The six walks on one API and one CPU worker's step, against the Redis at `redis_url` (a fresh one, or a
    namespace of its own): a submission (and another's reservation from where it is made), its job's claim, then its
    read; then the claims of a job whose image does not decode and of a job found late."""
    from app.services import services
    from bench.stack.corpus import photo_like_jpeg
    from contract.redis.connection import connect
    from contract.redis.keys import Keys
    from tasks.decoding.preprocess import Preprocessor

    walks: dict[str, Walk] = {}
    with private_api(redis_url, namespace) as app:
        client = app.test_client()
        image = photo_like_jpeg(1)

        def submit() -> Any:
            return client.post("/v1/jobs", data=image, content_type="image/jpeg")

        answer, walks["submission"] = follow(
            "a submission's reservation",
            submit,
            "app/placing.py:take",
            lambda local: local["self"].reservation,
            documents,
        )
        if answer.status_code != 202:
            raise RuntimeError(f"the submission answered {answer.status_code}: {answer.get_data(as_text=True)}")
        # The same reservation's whole life, from the call that makes it, through the body's reading to its job
        answer, walks["submission made"] = follow_from_birth(
            "a submission's reservation from where it is made",
            submit,
            "app/jobs.py:submit_job",
            "app/admission.py:before_body",
            documents,
        )
        if answer.status_code != 202:
            raise RuntimeError(f"the submission answered {answer.status_code}: {answer.get_data(as_text=True)}")
        job_id = answer.get_json()["id"]
        settings = services(app).settings
        worker = Preprocessor(settings, connect(settings))
        outcome, walks["claim"] = follow(
            "a claim's job id", lambda: worker.run(job_id), "tasks/decoding/preprocess.py:run", _job_id, documents
        )
        if str(outcome) != "pushed":
            raise RuntimeError(f"the claim's step ended {outcome!r}, not pushed")
        read, walks["read"] = follow(
            "a read's job id", lambda: client.get(f"/v1/jobs/{job_id}"), "app/jobs.py:get_job", _job_id, documents
        )
        if read.status_code != 200 or read.get_json()["id"] != job_id:
            raise RuntimeError(f"the read answered {read.status_code}")

        def claim_of(name: str, image: bytes, expected: str, prepare: Callable[[str], None] | None = None) -> Walk:
            answer = client.post("/v1/jobs", data=image, content_type="image/jpeg")
            if answer.status_code != 202:
                raise RuntimeError(f"the submission answered {answer.status_code}: {answer.get_data(as_text=True)}")
            job_id = answer.get_json()["id"]
            if prepare is not None:
                prepare(job_id)
            root = "tasks/decoding/preprocess.py:run"
            outcome, walk = follow(name, lambda: worker.run(job_id), root, _job_id, documents)
            if str(outcome) != expected:
                raise RuntimeError(f"{name}: the claim's step ended {outcome!r}, not {expected}")
            return walk

        # a JPEG's start and noise: the API takes it (it looks like a JPEG), its decode fails
        broken = photo_like_jpeg(2)[:300] + bytes(range(256)) * 2
        walks["claim failed"] = claim_of("a failed decode's claim", broken, "failed: decode_error")
        # Late as the claim judges it, by the record's deadline; the API's sweep reads the deadline index, which still
        # says the deadline is ahead, so it is the claim that finds the job late and ends it.
        job_prefix, control = Keys(settings.namespace).job_prefix, connect(settings)

        def past_deadline(job_id: str) -> None:
            control.hset(job_prefix + job_id, "deadline_at", "1")

        walks["claim late"] = claim_of("a late job's claim", photo_like_jpeg(3), "expired", past_deadline)
    return walks


def _job_id(arguments: dict[str, Any]) -> Any:
    return arguments["job_id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stops", action="store_true", help="print each walk's stops, not only its trail")
    parser.add_argument("--documents", action="store_true", help="a dict holding the value carries it too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="walks-") as workdir:
        server = RedisServer(Path(workdir))
        try:
            walks = measure(server.url, documents=args.documents)
        finally:
            server.stop()
    for walk in walks.values():
        text = walk.report()
        print(text if args.stops else "\n".join(text.splitlines()[:2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
