"""How a view declares its place in the OpenAPI document: `@operation(...)` and its `Reply`s.

Every blueprint imports this; app.openapi reads the declarations to build the document. Kept apart from
the builder so that a blueprint (app.metrics among them) needs nothing of the builder's imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from contract.settings import Settings


@dataclass(frozen=True)
class Reply:
    """One documented answer: a model (JSON), or a bare schema for another media type."""

    description: str
    model: type[BaseModel] | None = None
    media_type: str = "application/json"
    schema: dict[str, Any] | None = None
    headers: tuple[str, ...] = ()
    links: dict[str, dict[str, Any]] | None = None  # OpenAPI links: what a client can do next


@dataclass(frozen=True)
class Operation:
    summary: str
    tag: str
    replies: dict[int, Reply]
    problems: tuple[int | tuple[int, str], ...] = ()  # a status, or (status, what it means here)
    description: str = ""
    query: Callable[[Settings], type[BaseModel]] | None = None
    body: Callable[[Settings], dict[str, Any]] | None = None
    public: bool = False  # open even when API keys are configured


def operation(summary: str, *, tag: str, replies: dict[int, Reply], **details: Any) -> Callable:
    """Declare a view's place in the OpenAPI document."""
    declared = Operation(summary=summary, tag=tag, replies=replies, **details)

    def mark(view: Callable) -> Callable:
        view.openapi = declared  # type: ignore[attr-defined]
        return view

    return mark
