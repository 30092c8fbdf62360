"""Issue 60.1: what /openapi.json says a callback's signature covers is what the callback worker signs. A real
delivery's headers, made by contract.callbacks.callback_signature, are checked with the formula the served document
states: the one in its description's words, and the one it carries as data (`x-callback-signature`)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re

import requests

from app import create_app
from contract.callbacks.callback_signature import signed_headers
from contract.settings.config import load_settings
from tests.support import ApiServer

SECRET = "a-receivers-shared-secret-0123456789"


def _document(redis_url: str) -> dict:
    api = ApiServer(create_app(dataclasses.replace(load_settings(), redis_url=redis_url, namespace="sigdoc")))
    try:
        return requests.get(f"{api.url}/openapi.json", timeout=10).json()
    finally:
        api.stop()


def _delivery() -> tuple[dict[str, str], bytes]:
    body = json.dumps({"id": "0" * 32, "status": "succeeded"}).encode()
    return signed_headers(SECRET, "1765000000", "0" * 31 + "1", "delivery-1", body), body


def test_a_real_callback_verifies_with_the_formula_the_documents_words_state(redis_server):
    description = _document(redis_server.url)["info"]["description"]
    stated = re.search(r"`([\w-]+): (\w+=)<hex HMAC-SHA256 of \"([^\"]+)\" with the shared secret>`", description)
    assert stated, description
    header, prefix, template = stated.groups()
    headers, body = _delivery()

    def value(name: str) -> str:
        return body.decode() if name == "body" else headers[name]

    message = re.sub(r"<([\w-]+)>", lambda part: value(part.group(1)), template).encode()
    expected = prefix + hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(expected, headers[header])
    assert "X-Imgserve-Job-Id" in template  # the words before issue 60.1 left the job id out


def test_a_real_callback_verifies_with_the_signature_the_document_carries_as_data(redis_server):
    stated = _document(redis_server.url)["x-callback-signature"]
    headers, body = _delivery()
    assert stated["algorithm"] == "HMAC-SHA256" and stated["encoding"] == "hex"
    parts = [body if part == "body" else headers[part].encode() for part in stated["message"]["parts"]]
    message = stated["message"]["separator"].encode().join(parts)
    expected = stated["prefix"] + hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(expected, headers[stated["header"]])
    assert set(stated["headers"]) <= set(headers)
