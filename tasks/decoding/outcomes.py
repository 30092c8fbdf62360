"""What one job's CPU stage came to (tasks.decoding.preprocess), typed: the task's log line reads its kind and a
failure's error code from it rather than parsing them back out of text.

It is still the text it always was (the Celery task's result and the log line's message, byte for byte):
"pushed", "expired", "missing", "skipped (<why>)", "failed: <error code>".
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """The kind of outcome: the log line's `outcome` field."""

    PUSHED = "pushed"
    EXPIRED = "expired"
    MISSING = "missing"
    SKIPPED = "skipped"
    FAILED = "failed"


class StageOutcome(str):
    """An outcome that is its own text, so that it travels (Celery's result, the log) as it always did."""

    kind: Stage
    detail: str  # a failure's error code, or why a job was skipped; "" for the others

    def __new__(cls, kind: Stage, detail: str = "") -> StageOutcome:
        if not detail:
            text = kind.value
        elif kind is Stage.FAILED:
            text = f"{kind.value}: {detail}"
        else:
            text = f"{kind.value} ({detail})"
        outcome = super().__new__(cls, text)
        outcome.kind, outcome.detail = kind, detail
        return outcome

    @property
    def error_code(self) -> str:
        """A failure's error code, as the job's document carries it; "" for every other kind."""
        return self.detail if self.kind is Stage.FAILED else ""


PUSHED = StageOutcome(Stage.PUSHED)
EXPIRED = StageOutcome(Stage.EXPIRED)
MISSING = StageOutcome(Stage.MISSING)


def failed(code: str) -> StageOutcome:
    return StageOutcome(Stage.FAILED, code)


def skipped(why: str) -> StageOutcome:
    return StageOutcome(Stage.SKIPPED, why)
