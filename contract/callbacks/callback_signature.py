"""What a callback's signature covers, in one place: the callback worker signs with it (`signed_headers`) and
app.openapi states it (`/openapi.json`'s description and its `x-callback-signature`), so the document cannot say
one thing while the callback worker signs another.

The signature is `X-Signature: sha256=<hex HMAC-SHA256(secret, message)>`, the message being the values of
SIGNED_PARTS joined by SEPARATOR: `<X-Imgserve-Timestamp>.<X-Imgserve-Job-Id>.<body>`. The secret is the job's
API key's own (`auth.api_keys[].callback_secret_env` or `_file`), or `callbacks.secret` when the deployment has no
keys (contract.callbacks' callback_secret). docs/operations.md, "Callbacks", has a receiver that refuses stale and
replayed deliveries.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

SIGNATURE_HEADER = "X-Signature"
TIMESTAMP_HEADER = "X-Imgserve-Timestamp"
JOB_ID_HEADER = "X-Imgserve-Job-Id"
DELIVERY_ID_HEADER = "X-Imgserve-Delivery-Id"  # the same on every attempt of one job's callback
SIGNATURE_PREFIX = "sha256="
ALGORITHM = "HMAC-SHA256"
BODY = "body"  # in SIGNED_PARTS: the request's body as sent, byte for byte
SIGNED_PARTS = (TIMESTAMP_HEADER, JOB_ID_HEADER, BODY)
SEPARATOR = "."


def signed_message(timestamp: str, job_id: str, body: bytes) -> bytes:
    """The bytes the signature covers: SIGNED_PARTS' values joined by SEPARATOR."""
    values = {TIMESTAMP_HEADER: timestamp.encode(), JOB_ID_HEADER: job_id.encode(), BODY: body}
    return SEPARATOR.encode().join(values[part] for part in SIGNED_PARTS)


def sign(secret: str, timestamp: str, job_id: str, body: bytes) -> str:
    """The X-Signature header's value."""
    digest = hmac.new(secret.encode(), signed_message(timestamp, job_id, body), hashlib.sha256).hexdigest()
    return SIGNATURE_PREFIX + digest


def signed_headers(secret: str, timestamp: str, job_id: str, delivery_id: str, body: bytes) -> dict[str, str]:
    """A delivery's headers: the JSON body's type, who and when, and the signature over them."""
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: timestamp,
        JOB_ID_HEADER: job_id,
        DELIVERY_ID_HEADER: delivery_id,
        SIGNATURE_HEADER: sign(secret, timestamp, job_id, body),
    }


def formula() -> str:
    """The signature as the API document states it, in words a reader can follow."""
    message = SEPARATOR.join("<body>" if part == BODY else f"<{part}>" for part in SIGNED_PARTS)
    return f'`{SIGNATURE_HEADER}: {SIGNATURE_PREFIX}<hex {ALGORITHM} of "{message}" with the shared secret>`'


def described() -> dict[str, Any]:
    """The signature as data (`x-callback-signature` in /openapi.json): what a receiver checks, part by part."""
    return {
        "header": SIGNATURE_HEADER,
        "prefix": SIGNATURE_PREFIX,
        "algorithm": ALGORITHM,
        "encoding": "hex",
        "message": {"parts": list(SIGNED_PARTS), "separator": SEPARATOR},
        "headers": [TIMESTAMP_HEADER, JOB_ID_HEADER, DELIVERY_ID_HEADER],
    }
