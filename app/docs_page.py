"""The docs page (`/docs`): its HTML template and the two helpers it renders with.

app.openapi renders it once per app from the OpenAPI document (`published`); the page's "Try it" script is
app/docs_try.js, served by app.home.
"""

from __future__ import annotations

import re
from typing import Any

from markupsafe import Markup, escape


def code_spans(text: str) -> Markup:
    """Markdown's `code` as <code>, everything else escaped."""
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", str(escape(text or ""))))


def describe_schema(schema: dict[str, Any]) -> str:
    """A one-line type for the docs page: `JobDocument`, `integer 1..1000`, `Detection[]`, `string | null`."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(describe_schema(s) for s in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        return " | ".join(repr(v) for v in schema.get("enum", [schema.get("const")]))
    kind = schema.get("type", "any")
    if kind == "array":
        return describe_schema(schema.get("items", {})) + "[]"
    if kind == "object" and "additionalProperties" in schema:
        return "map of " + describe_schema(schema["additionalProperties"])
    low, high = schema.get("minimum"), schema.get("maximum")
    bounds = (
        f" {low if low is not None else ''}..{high if high is not None else ''}" if (low, high) != (None, None) else ""
    )
    return f"{kind}{' (' + schema['format'] + ')' if 'format' in schema else ''}{bounds}"


DOCS_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ doc.info.title }} API {{ doc.info.version }}</title>
<style>
body{font:15px/1.5 system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
code,pre{font:13px ui-monospace,monospace;background:#f4f4f4;padding:1px 4px;border-radius:3px}
pre{padding:.8em;white-space:pre-wrap}
table{border-collapse:collapse;width:100%;margin:.4em 0 1em}
td,th{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
.op{border:1px solid #ccc;border-radius:6px;padding:.2em 1em;margin:1em 0}
.m{display:inline-block;min-width:4.5em;font-weight:bold;color:#fff;border-radius:3px;text-align:center}
.get{background:#2b7bb9}.post{background:#2e8b57}.delete{background:#b22222}
form.try{background:#fafafa;border-top:1px dashed #ccc;margin:.5em -1em 0;padding:.5em 1em}
form.try label{margin-right:1em;white-space:nowrap}
</style><script src="docs/try.js" defer></script></head><body>
<h1>{{ doc.info.title }} API <small>{{ doc.info.version }}</small></h1>
{% for para in doc.info.description.split("\n\n") %}<p>{{ code(para) }}</p>{% endfor %}
<p>Machine-readable: <a href="openapi.json"><code>/openapi.json</code></a> (OpenAPI {{ doc.openapi }}).
Each operation's <b>Try it</b> sends its request to this service from the browser.</p>
{% if doc.components.securitySchemes %}<p><label>API key (sent as <code>Authorization: Bearer</code>)
<input id="api-key" type="password" autocomplete="off"></label></p>{% endif %}
{% for path, methods in doc.paths.items() %}{% for method, op in methods.items() %}
<div class="op" id="{{ op.operationId }}">
<h3><span class="m {{ method }}">{{ method|upper }}</span> <code>{{ path }}</code> {{ op.summary }}</h3>
{% if op.description %}<p>{{ code(op.description) }}</p>{% endif %}
{% if op.security %}<p>Needs <code>Authorization: Bearer &lt;key&gt;</code>.</p>{% endif %}
{% if op.parameters %}<table><tr><th>Parameter</th><th>In</th><th>Type</th><th>Description</th></tr>
{% for p in op.parameters %}<tr><td><code>{{ p.name }}</code></td><td>{{ p.in }}</td>
<td>{{ describe(p.schema) }}</td><td>{{ code(p.description) }}</td></tr>{% endfor %}</table>{% endif %}
{% if op.requestBody %}<p><b>Body</b>: {{ code(op.requestBody.description) }}<br>
{% for media in op.requestBody.content %}<code>{{ media }}</code> {% endfor %}</p>{% endif %}
<form class="try" data-method="{{ method|upper }}" data-path="{{ path }}"><b>Try it</b>
{% for p in op.parameters or [] %}<label><code>{{ p.name }}</code> <input name="{{ p.name }}" data-in="{{ p.in }}"
{% if p.required %}required {% endif %}placeholder="{{ describe(p.schema) }}"></label> {% endfor %}
{% if op.requestBody %}<label><code>image</code> <input name="image" type="file" accept="image/*" required></label>
{% endif %}<button>Send</button><pre class="answer" hidden></pre></form>
<table><tr><th>Status</th><th>Description</th><th>Body</th></tr>
{% for status, reply in op.responses.items() %}<tr><td>{{ status }}</td><td>{{ code(reply.description) }}{% for name, link in (reply.links or {}).items() %}<br>next: <a href="#{{ link.operationId }}">{{ name }}</a>{% endfor %}</td><td>
{% for media, body in (reply.content or {}).items() %}<code>{{ media }}</code>
{% if body.schema and body.schema["$ref"] %}<a href="#{{ describe(body.schema) }}">{{ describe(body.schema) }}</a>{% endif %}
{% endfor %}</td></tr>{% endfor %}</table></div>
{% endfor %}{% endfor %}
<h2>Schemas</h2>
{% for name, schema in doc.components.schemas.items() %}
<h3 id="{{ name }}">{{ name }}</h3>{% if schema.description %}<p>{{ code(schema.description) }}</p>{% endif %}
<table><tr><th>Field</th><th>Type</th><th>Required</th><th>Description</th></tr>
{% for field, prop in (schema.properties or {}).items() %}<tr><td><code>{{ field }}</code></td>
<td>{{ describe(prop) }}</td><td>{{ "yes" if field in (schema.required or []) else "" }}</td>
<td>{{ code(prop.description) }}</td></tr>{% endfor %}</table>
{% endfor %}
</body></html>
"""
