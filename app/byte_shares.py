"""An API key's share of the byte budgets (auth.max_waiting_bytes_share, contract.admission.budget): its size, and the
429 a key past it gets, its own (the other keys are still admitted)."""

from __future__ import annotations

from collections.abc import Callable

from app.problems import Problem
from contract.admission import budget
from contract.settings import Settings
from contract.settings.models import ModelSpec


def key_byte_shares(settings: Settings, spec: ModelSpec) -> tuple[int, int]:
    """An API key's share of `spec`'s byte budget and of the total's, in bytes, alone (with other keys' uploads
    waiting, of what they leave: contract.admission.budget)."""
    ratio = settings.auth.max_waiting_bytes_share
    total = settings.backpressure.max_total_waiting_bytes
    return int(settings.max_waiting_bytes(spec) * ratio), int(total * ratio)


def key_share_refusal(
    spec: ModelSpec,
    request: budget.AdmissionRequest,
    verdict: budget.BudgetVerdict,
    retry_after: Callable[[ModelSpec, float], int],
) -> Problem | None:
    """The 429 of a key whose uploads waiting are past its share of the model's byte budget or of the total's, naming
    the share; `retry_after` the seconds until a share of the model's waiting work has drained. None when `verdict`
    is no such refusal."""
    if verdict.verdict == budget.OVER_KEY_MODEL_BYTES:
        share, held, waiting = (
            verdict.share or request.max_owner_model_bytes,
            verdict.model_bytes,
            f"for model {spec.key}",
        )
        budget_name = f"model {spec.key}'s byte budget"
    elif verdict.verdict == budget.OVER_KEY_ALL_BYTES:
        share, held, waiting = verdict.share or request.max_owner_all_bytes, verdict.all_bytes, "for all models"
        budget_name = "the total byte budget"
    else:
        return None
    # what must drain before this upload fits in the key's share, as a part of what waits
    retry = retry_after(spec, (verdict.key_bytes + request.size - share) / max(1, held))
    return Problem(
        429,
        "overloaded",
        "Too many requests",
        f"your key has {verdict.key_bytes} bytes of images waiting {waiting} (your share of what the other "
        f"keys leave of {budget_name} is {share}); retry later",
        headers={"Retry-After": str(retry)},
    )
