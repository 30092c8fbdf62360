"""What the API's request handlers use: one `Services` per app, built by `create_app`, and `services()`, the typed
way to reach it (instead of an untyped look-up in `current_app.extensions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis
from flask import Flask, current_app
from redis import Redis

from app.admission import Admission
from app.callback_lookups import CallbackLookups
from app.cells import Cells
from app.holds import Holds
from app.waiters import JobEventListener
from contract.cache import ResultCache
from contract.jobs.ids import JobIds
from contract.jobs.intake import JobIntake
from contract.jobs.task_messages import PreprocessMessages
from contract.redis.keys import Keys
from contract.settings import Settings
from contract.settings.models import Catalogue

EXTENSION = "imgserve"  # the key in app.extensions


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    keys: Keys
    store: JobIntake
    catalogue: Catalogue
    admission: Admission  # routing, the budgets and the result cache's lookup (app.admission)
    task_messages: PreprocessMessages  # the CPU task of each job, pushed with the job itself
    listener: JobEventListener
    cache: ResultCache  # answers for repeated images (contract.cache)
    holds: Holds  # what one client may hold in this process at once (app.holds)
    callback_lookups: CallbackLookups  # callback hosts looked up off the event loop, bounded per key
    job_ids: JobIds  # makes and checks job ids (contract.jobs.ids)
    # Every cell (app.cells); redis, keys, store, admission, listener and cache above are the first cell's.
    cells: Cells
    tier: Redis  # the API tier's own Redis: the first cell's without `cells`


def services(app: Flask | None = None) -> Services:
    """The Services of `app`, by default the one handling this request."""
    return cast(Services, (current_app if app is None else app).extensions[EXTENSION])
