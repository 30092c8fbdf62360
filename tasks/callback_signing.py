"""How a callback is signed: the headers a receiver checks (docs/operations.md, "Callbacks", has one that
refuses stale and replayed deliveries).

`X-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + job id + "." + body)>`, with
`X-Imgserve-Timestamp: <unix seconds>` and `X-Imgserve-Job-Id`: contract.callback_signature's, which the API's
document states too. The secret is the job's API key's own (`auth.api_keys[].callback_secret_env` or `_file`),
or `callbacks.secret` when the deployment has no keys (contract.callbacks' callback_secret).
"""

from __future__ import annotations

from contract.callback_signature import (
    DELIVERY_ID_HEADER,
    JOB_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    sign,
)

__all__ = ["DELIVERY_ID_HEADER", "JOB_ID_HEADER", "SIGNATURE_HEADER", "TIMESTAMP_HEADER", "sign", "signed_headers"]


def signed_headers(secret: str, timestamp: str, job_id: str, delivery_id: str, body: bytes) -> dict[str, str]:
    """A delivery's headers: the JSON body's type, who and when, and the signature over them."""
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: timestamp,
        JOB_ID_HEADER: job_id,
        DELIVERY_ID_HEADER: delivery_id,
        SIGNATURE_HEADER: sign(secret, timestamp, job_id, body),
    }
