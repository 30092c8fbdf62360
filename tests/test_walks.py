"""A value's walk through the product's files (bench.meters.walks): a submission's reservation (from the step that
takes its body in, and its whole life from the call that makes it), a claim's job id (on
its way to the frame's push, and on its two ways to an end of the claim's own: a failed decode, a late job) and a
read's job id each enter at most 4 files and come back to a file they left at most twice. A step's orchestrator calls
one facade per step, each facade names its own keys, and an id is checked once at the edge (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.meters.walks import Stop, Walk, carries, measure, way_of
from contract.jobs.intake import NewJob

pytestmark = pytest.mark.integration

MOST_FILES, MOST_RETURNS = 4, 2


@pytest.fixture(scope="module")
def walks(redis_server) -> Iterator[dict[str, Walk]]:
    yield measure(redis_server.url, namespace="test-walks")


@pytest.mark.parametrize("name", ["submission", "submission made", "claim", "read", "claim failed", "claim late"])
def test_each_walk_enters_at_most_four_files_and_comes_back_at_most_twice(walks, name):
    walk = walks[name]
    assert len(walk.files) <= MOST_FILES and walk.returns <= MOST_RETURNS, walk.report()
    # and counting each way back to a caller: a facade calling a helper elsewhere for each key would pass the above
    assert walk.returns_to_callers <= MOST_RETURNS, " -> ".join(walk.way)


def test_the_walks_go_where_their_steps_go(walks):
    """Each walk reached the facade its step hands the value to: a count that lost the value early would pass."""
    assert walks["submission"].files == ["app/placing.py", "app/admission.py"]
    assert (
        "contract/jobs/handoff.py" in walks["claim"].files and "contract/frames/frame_push.py" in walks["claim"].files
    )
    assert walks["read"].files[0] == "app/jobs.py" and "contract/jobs/record.py" in walks["read"].files
    for ended in ("claim failed", "claim late"):  # the claim's facade ends the job itself: to Redis from there
        assert walks[ended].trail[:4] == [
            "tasks/decoding/preprocess.py",
            "contract/jobs/handoff.py",
            "tasks/decoding/preprocess.py",
            "contract/jobs/handoff.py",
        ], walks[ended].report()
    assert all("contract/redis/keys.py" not in walk.files for walk in walks.values())  # each facade names its keys


def test_the_reservation_is_followed_from_where_it_is_made(walks):
    """The submission's reservation from the call that makes it (Admission.before_body) to the step that hands its
    bytes to the job, held above like the others: made in app/admission.py, held by app/placing.py's Placement while
    app/jobs.py reads the body (called back, it never sees the reservation), then routed and taken in by one call
    back into app/admission.py (Admission.take), which hands the store only its `take_in` (docs/architecture.md)."""
    made = walks["submission made"]
    assert made.stops[0] == Stop("app/admission.py", "Admission.before_body"), made.report()
    assert made.files == ["app/admission.py", "app/placing.py"], made.report()
    assert made.trail == ["app/admission.py", "app/placing.py", "app/admission.py"], made.report()
    assert Stop("app/admission.py", "Admission.take_in") in made.stops  # followed to its bytes' hand-off
    # the part from `Placement.take` on is the "submission" walk's, at its end
    assert made.stops[-len(walks["submission"].stops) :] == walks["submission"].stops


def test_the_count_sees_a_return_and_a_value_held_one_level_down():
    walk = Walk("back and forth", [Stop(file, "f") for file in ("a.py", "b.py", "b.py", "a.py", "c.py", "b.py")])
    assert walk.files == ["a.py", "b.py", "c.py"] and walk.trail == ["a.py", "b.py", "a.py", "c.py", "b.py"]
    assert walk.returns == 2
    # a calls b, b returns, a calls c (through d, which does not carry the value), c calls a's helper: the way back
    # from b into a counts, and so does the helper's a; the ways back out after the last stop do not
    calls = [(Stop(file, "f"), file != "d.py") for file in ("a.py", "b.py", "d.py", "c.py", "a.py")]
    way = way_of(calls, [0, 1, ~1, 2, 3, 4, ~4, ~3, ~2, ~0])
    assert way == ["a.py", "b.py", "a.py", "c.py", "a.py"] and Walk("w", way=way).returns_to_callers == 2
    job_id = "1" * 32
    assert carries("".join(["1"] * 32), job_id)  # an equal string, not the same object
    assert carries(NewJob(job_id, b"", 1, {}), job_id)  # a NamedTuple's field
    assert not carries({"id": job_id}, job_id) and carries({"id": job_id}, job_id, documents=True)
    assert not carries([[job_id]], job_id)  # two levels down: not followed
