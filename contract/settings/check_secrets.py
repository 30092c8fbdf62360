"""python -m contract.settings.check_secrets NAME [NAME ...]: refuse to start with placeholder or short secrets.

The compose file runs it before every other service: each named environment
variable must be set to a usable secret (weak_secret_reason below).
`FLOWER_BASIC_AUTH` is `user:password[,user:password]`, and each password is checked.
A name ending in `?` may be empty (a feature left off), but not weak when set.
Exit 0 when all are usable; 1, naming each that is not, otherwise.
"""

from __future__ import annotations

import os
import sys

from contract.settings.sections import SettingsError

# The rules a secret must pass, here and wherever the settings hold one (check_secret).
MIN_SECRET_LENGTH = 16
_PLACEHOLDERS = ("change-me", "changeme", "change_me", "replace-me", "replaceme", "placeholder", "your-secret")


def weak_secret_reason(value: str) -> str | None:
    """Why a secret must not be used (empty, a placeholder, too short), or None."""
    if not value:
        return "empty"
    if any(placeholder in value.lower() for placeholder in _PLACEHOLDERS):
        return "a placeholder"
    if len(value) < MIN_SECRET_LENGTH:
        return f"shorter than {MIN_SECRET_LENGTH} characters"
    if len(set(value)) < 6:
        return "too repetitive"
    return None


def check_secret(name: str, value: str) -> None:
    """Refuse a placeholder or short secret: a process that would run with one does not start."""
    reason = weak_secret_reason(value)
    if reason:
        raise SettingsError(
            f"{name} is {reason}; generate one with python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )


def problems(names: list[str], environ: dict[str, str]) -> list[str]:
    found = []
    for raw_name in names:
        name, optional = raw_name.rstrip("?"), raw_name.endswith("?")
        value = environ.get(name, "")
        if not value:
            if not optional:
                found.append(f"{name} is not set")
            continue
        for label, secret in _secrets_in(name, value):
            reason = weak_secret_reason(secret)
            if reason:
                found.append(f"{label} is {reason}")
    return found


def _secrets_in(name: str, value: str) -> list[tuple[str, str]]:
    if name != "FLOWER_BASIC_AUTH":
        return [(name, value)]
    pairs = []
    for pair in value.split(","):
        user, _, password = pair.partition(":")
        pairs.append((f"{name}'s password for {user or '(no user)'}", password))
    return pairs


def main(argv: list[str] | None = None) -> int:
    found = problems(list(sys.argv[1:] if argv is None else argv), dict(os.environ))
    for problem in found:
        print(
            f"refusing to start: {problem}; generate one with "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'",
            file=sys.stderr,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
