// The docs page's "Try it" forms (one under each operation, app/docs_page.py): each sends its request to
// this same origin and shows the answer as text. Served from the repository (GET /docs/try.js); the page's
// policy lets it run and fetch from this origin only. Nothing an answer holds is ever read as HTML.
"use strict";

// The request a form describes: its path with the path parameters filled in, its query, its body.
function requestFor(method, path, fields, apiKey) {
  const query = new URLSearchParams();
  let body = null;
  for (const field of fields) {
    if (field.file) {
      body = new FormData();
      body.append(field.name, field.file);
    } else if (field.value === "") {
      continue;
    } else if (field.where === "path") {
      path = path.replace("{" + field.name + "}", encodeURIComponent(field.value));
    } else {
      query.append(field.name, field.value);
    }
  }
  const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
  // Relative to the page (/docs): the same origin, and the same prefix behind a proxy that adds one.
  const url = "." + path + (query.toString() ? "?" + query.toString() : "");
  return { url: url, init: { method: method, headers: headers, body: body } };
}

function describe(response, text) {
  let body = text;
  try {
    body = JSON.stringify(JSON.parse(text), null, 2);
  } catch (notJson) {
    // shown as it came
  }
  const heads = ["Content-Type", "Location", "Retry-After"]
    .filter((name) => response.headers.get(name))
    .map((name) => name + ": " + response.headers.get(name));
  return [response.status + " " + response.statusText].concat(heads, ["", body]).join("\n");
}

function fieldsOf(form) {
  return Array.from(form.querySelectorAll("input[name]")).map((input) => ({
    name: input.name,
    where: input.dataset.in,
    value: input.type === "file" ? "" : input.value,
    file: input.type === "file" && input.files.length ? input.files[0] : null,
  }));
}

async function send(form) {
  const answer = form.querySelector(".answer");
  const key = document.getElementById("api-key");
  const request = requestFor(form.dataset.method, form.dataset.path, fieldsOf(form), key ? key.value : "");
  answer.hidden = false;
  answer.textContent = form.dataset.method + " " + request.url + " ...";
  try {
    const response = await fetch(request.url, request.init);
    const text = await response.text();
    answer.textContent = describe(response, text);
    const id = /"id":\s*"([0-9a-f]{32})"/.exec(text);
    if (id) {
      // The job just made is the one the other forms most likely want next.
      document.querySelectorAll('input[name="job_id"]').forEach((input) => (input.value = id[1]));
    }
  } catch (error) {
    answer.textContent = "no answer: " + error;
  }
}

if (typeof document !== "undefined") {
  document.querySelectorAll("form.try").forEach((form) => {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      send(form);
    });
  });
}
if (typeof module !== "undefined") {
  module.exports = { requestFor: requestFor, describe: describe };
}
