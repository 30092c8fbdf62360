"""`GET /`: where to go from here (the docs, health, Flower), and the docs page's request script.

A first visit to the service's address answered 404. It answers the links now: as JSON, or as a page for a
browser (one that prefers text/html).
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Flask, Response, current_app, jsonify, request
from jinja2 import Template

from app.openapi import Reply, operation, service_version
from app.services import services as current_services
from contract.documents.status_documents import Home

blueprint = Blueprint("home", __name__)

# The docs page's "Try it" forms run this, from the repository: nothing is fetched from anywhere else.
TRY_SCRIPT = Path(__file__).with_name("docs_try.js")


@blueprint.get("/")
@operation(
    "Where to go from here: the docs, health, readiness, Flower",
    tag="meta",
    public=True,
    description="JSON; a browser (Accept preferring text/html) gets the same links as a page.",
    replies={200: Reply("Links to the service's pages", Home)},
)
def home() -> Response:
    settings = current_services().settings
    base = request.host_url.rstrip("/")
    links = {
        "docs": f"{base}/docs",
        "openapi": f"{base}/openapi.json",
        "submit": f"{base}/v1/jobs",
        "models": f"{base}/v1/models",
        "health": f"{base}/healthz",
        "ready": f"{base}/readyz",
        "stats": f"{base}/v1/stats",
        **({"flower": settings.api.flower_url} if settings.api.flower_url else {}),
    }
    body = Home(
        name="imgserve",
        version=service_version(),
        links=links,
        try_it=f'curl -F image=@samples/shapes-36.jpg "{base}/v1/jobs?wait=10"',
    )
    if request.accept_mimetypes.best_match(["application/json", "text/html"]) == "text/html":
        return Response(home_page(current_app).render(home=body), mimetype="text/html")
    return jsonify(body.to_json())


@blueprint.get("/docs/try.js")
@operation(
    "The script of the docs page's request forms",
    tag="meta",
    public=True,
    replies={200: Reply("JavaScript", media_type="text/javascript", schema={"type": "string"})},
)
def try_script() -> Response:
    response = Response(_script(), mimetype="text/javascript")
    response.cache_control.max_age = 300
    return response


def home_page(app: Flask) -> Template:
    """HOME_PAGE compiled once per app, in its Jinja environment (autoescaping as render_template_string's):
    compiling it on every request would cost the API's time to anyone, without a key."""
    page = app.extensions.get("imgserve.home_page")
    if page is None:
        page = app.extensions["imgserve.home_page"] = app.jinja_env.from_string(HOME_PAGE)
    return page


_loaded: list[bytes] = []


def _script() -> bytes:
    if not _loaded:
        _loaded.append(TRY_SCRIPT.read_bytes())
    return _loaded[0]


HOME_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>imgserve {{ home.version }}</title>
<style>body{font:15px/1.5 system-ui,sans-serif;max-width:760px;margin:2em auto;padding:0 1em;color:#222}
code{font:13px ui-monospace,monospace;background:#f4f4f4;padding:1px 4px;border-radius:3px}</style></head><body>
<h1>imgserve <small>{{ home.version }}</small></h1>
<p>Object detection: submit an image, read its job. Try it:</p><p><code>{{ home.try_it }}</code></p>
<ul>{% for name, url in home.links.items() %}<li><a href="{{ url }}">{{ name }}</a> <code>{{ url }}</code></li>
{% endfor %}</ul>
<p>The <a href="{{ home.links.docs }}">docs page</a> can send each request from the browser.</p>
</body></html>
"""
