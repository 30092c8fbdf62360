"""How a callback is signed: the headers a receiver checks (docs/operations.md, "Callbacks", has one that
refuses stale and replayed deliveries).

`X-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + job id + "." + body)>`, with
`X-Imgserve-Timestamp: <unix seconds>` and `X-Imgserve-Job-Id`. The secret is the job's API key's own
(`auth.api_keys[].callback_secret_env` or `_file`), or `callbacks.secret` when the deployment has no keys
(contract.callbacks' callback_secret).
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-Signature"
TIMESTAMP_HEADER = "X-Imgserve-Timestamp"
JOB_ID_HEADER = "X-Imgserve-Job-Id"
DELIVERY_ID_HEADER = "X-Imgserve-Delivery-Id"  # the same on every attempt of one job's callback


def sign(secret: str, timestamp: str, job_id: str, body: bytes) -> str:
    message = f"{timestamp}.{job_id}.".encode() + body
    return "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signed_headers(secret: str, timestamp: str, job_id: str, delivery_id: str, body: bytes) -> dict[str, str]:
    """A delivery's headers: the JSON body's type, who and when, and the signature over them."""
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: timestamp,
        JOB_ID_HEADER: job_id,
        DELIVERY_ID_HEADER: delivery_id,
        SIGNATURE_HEADER: sign(secret, timestamp, job_id, body),
    }
