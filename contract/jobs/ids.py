"""Job ids a client can check: the API alone can make one, and an id answers only to the
key that submitted it.

An id is 32 hex digits, as before (JOB_ID_PATTERN): `1`, the moment it was issued (the service clock's
milliseconds, 11 digits), 48 random bits, then a check, 32 bits of HMAC-SHA256 under the deployment's id secret
over all that and the submitting API key's id (`owner`; "" without keys). So:

- a made-up or mistyped id, or a real one asked for by another key, fails the check: `404 job-not-found`,
  the answer to an id that names nothing, given before any Redis call;
- an id that passes it was issued by this deployment to this key: only then may a record the store no longer
  holds be called lost (`410 job-lost`, contract.jobs.record.lost_at).

With cells (contract.settings.cells), an id names the cell its job lives in, inside what the check covers: format `2`,
the moment, one hex digit for the cell's place in `cells`, then 44 random bits. A read goes to that cell with no
lookup; an id whose cell digit was changed fails its check like any forged one. A deployment of one cell keeps
issuing `1` (an API from before cells reads those), and ids of format `1` and `0` live in the first cell.

Ids made before this format begin with `0` (their first 12 digits were the milliseconds, below 2^44 until
the year 2527): UNCHECKED, read as before (found, or 404) but never called lost, since nothing proves that the
service issued one. `jobs.accept_unchecked_ids: false` answers them 404 unread, once all of them are gone.

The secret: `jobs.id_secret` (IMGSERVE_JOB_ID_SECRET), the same for every API process of a deployment;
unset, one made once in var/job-id-secret (what `make run`'s processes share), else one derived from the
control Redis's URL and namespace (a container that cannot write var/: its Redis password makes it secret).
A new secret makes every id issued under the old one 404.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from enum import StrEnum
from pathlib import Path

from contract.jobs.record import JOB_ID_PATTERN
from contract.redis.clock import now as service_now
from contract.settings import REPO_ROOT, Settings

CHECKED_FORMAT = "1"  # the first digit of a checked id
CELL_FORMAT = "2"  # ...of a checked id that names its cell
UNCHECKED_FORMAT = "0"  # ...and of one made before them
CELL_DIGIT = 12  # where a cell id's cell is: after the format and the moment
HEAD_DIGITS = 24  # the format, the moment, the random bits: what the check covers, with the owner
CHECK_DIGITS = 8
SECRET_FILE = REPO_ROOT / "var" / "job-id-secret"
_SHAPE = re.compile(JOB_ID_PATTERN[1:-1])  # checked here, where the id's format is: the id goes nowhere else

log = logging.getLogger("imgserve.jobs")


class IdVerdict(StrEnum):
    """What an id is to the key asking for it, told from the id alone."""

    OURS = "ours"  # issued by this deployment to this key: look it up; missing within its TTL, lost
    UNCHECKED = "unchecked"  # the format before checks: look it up; missing, 404
    NOT_OURS = "not-ours"  # made up, mistyped, another key's or not an id: 404 unread


class JobIds:
    """Makes a deployment's job ids and checks them."""

    def __init__(self, secret: bytes, accept_unchecked: bool = True, cells: int = 1) -> None:
        if len(secret) < 16:
            raise ValueError("a job id secret of at least 16 bytes")
        if not 1 <= cells <= 16:
            raise ValueError("1 to 16 cells: an id names its cell in one hex digit")
        self._secret = secret
        self.accept_unchecked = accept_unchecked
        self.cells = cells  # more than one: ids name their cell (format 2)

    def new(self, owner: str = "", at: float | None = None, cell: int = 0) -> str:
        """A new id for a job the key `owner` submits ("" without keys), issued now (or `at`), living in the cell
        at `cell` (its place in `cells`)."""
        issued = service_now() if at is None else at
        if self.cells > 1:
            if not 0 <= cell < self.cells:
                raise ValueError(f"no cell {cell} of {self.cells}")
            head = f"{CELL_FORMAT}{int(issued * 1000):011x}{cell:x}{secrets.token_hex(6)[1:]}"
        else:
            head = f"{CHECKED_FORMAT}{int(issued * 1000):011x}{secrets.token_hex(6)}"
        return head + self._check(head, owner)

    def check(self, job_id: str, owner: str = "") -> tuple[IdVerdict, int]:
        """What `job_id` is to the key `owner` and the place of the cell it names (cell_of), in the one call a
        request makes at its edge: the id need not travel to the cells to be placed."""
        verdict = self.verdict(job_id, owner)
        return verdict, self.cell_of(job_id) if verdict is not IdVerdict.NOT_OURS else 0

    def verdict(self, job_id: str, owner: str = "") -> IdVerdict:
        """What `job_id` is to the key `owner`: no lookup, no clock."""
        if _SHAPE.fullmatch(job_id) is None:
            return IdVerdict.NOT_OURS
        if job_id[0] == UNCHECKED_FORMAT:
            return IdVerdict.UNCHECKED if self.accept_unchecked else IdVerdict.NOT_OURS
        if job_id[0] in (CHECKED_FORMAT, CELL_FORMAT) and hmac.compare_digest(
            job_id[HEAD_DIGITS:], self._check(job_id[:HEAD_DIGITS], owner)
        ):
            return IdVerdict.OURS
        return IdVerdict.NOT_OURS

    @staticmethod
    def cell_of(job_id: str) -> int:
        """The place in `cells` of the cell `job_id` lives in: its cell digit in format 2, else the first cell (0).
        Trusted only of an id whose verdict is OURS: the check covers the digit."""
        return int(job_id[CELL_DIGIT], 16) if job_id[:1] == CELL_FORMAT else 0

    def _check(self, head: str, owner: str) -> str:
        message = f"{head}\n{owner}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:CHECK_DIGITS]


def job_ids(settings: Settings, secret_file: Path = SECRET_FILE) -> JobIds:
    """The deployment's JobIds, its secret found as the module says."""
    return JobIds(id_secret(settings, secret_file), settings.jobs.accept_unchecked_ids, max(1, len(settings.cells)))


def id_secret(settings: Settings, secret_file: Path = SECRET_FILE) -> bytes:
    if settings.jobs.id_secret:
        return settings.jobs.id_secret.encode()
    try:
        return _file_secret(secret_file)
    except OSError as exc:
        log.warning(
            "jobs.id_secret is not set and %s cannot be made (%s): job ids are checked with a secret derived from "
            "redis_url, secret only as far as its password is; set IMGSERVE_JOB_ID_SECRET",
            secret_file,
            exc,
        )
        material = f"{settings.redis_url}\n{settings.namespace}".encode()
        return hmac.new(b"imgserve job ids", material, hashlib.sha256).digest()


def _file_secret(path: Path) -> bytes:
    """The secret in `path`, made there first if it is not (the first of several processes to make it wins)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secrets.token_urlsafe(32).encode())
        finally:
            os.close(fd)
        try:
            os.link(draft, path)  # never replaces one another process made meanwhile
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    secret = path.read_bytes().strip()
    if len(secret) < 16:
        raise OSError(f"{path} holds no usable secret")
    return secret
