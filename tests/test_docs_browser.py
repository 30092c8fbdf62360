"""The docs page's "Try it" forms in a real browser (issue 69): Debian's Chromium, driven by Playwright against the
test stack's API. An image from samples/ goes through the submit form, the job is read through the next form (the
page fills in the id it was given), and an answer holding HTML is shown as text: no element made of it, no script
run. tests/test_home.py runs the script's request building under node; only a browser runs the page itself."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT

# Debian's package (scripts/bootstrap --dev installs it); Playwright never downloads a browser of its own here.
CHROMIUM = Path("/usr/bin/chromium")
# As root, in a container, without network beyond this machine: no sandbox, no GPU, nothing fetched in the
# background (updates, sync, QUIC probes).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ANSWER_TIMEOUT_MS = 30_000
# Sent where the API echoes a value back in its problem's detail: shown as text, it makes nothing.
# No slash: it goes in a path too.
MARKUP = "<img src=x onerror=window.injected=1><b>bold"

# What markup in an answer would make, counted before and after: elements inside the answers, images, bold.
ELEMENTS = (
    "({in_answers: document.querySelectorAll('.answer *').length, images: document.querySelectorAll('img').length,"
    " bold: document.querySelectorAll('b').length})"
)

# Only a missing browser skips: Playwright is a dev dependency, so without it the test fails.
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() and shutil.which("chromium") is None,
    reason="no Chromium here (apt-get install chromium; scripts/bootstrap --dev does)",
)


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One page of a fresh headless Chromium (its own profile folder)."""
    from playwright.sync_api import sync_playwright

    executable = str(CHROMIUM) if CHROMIUM.exists() else shutil.which("chromium")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
        )
        page = context.new_page()
        page.set_default_timeout(ANSWER_TIMEOUT_MS)
        yield page
        context.close()


def _form(page: Any, method: str, path: str) -> Any:
    return page.locator(f'form.try[data-method="{method}"][data-path="{path}"]')


def _send_and_read(form: Any, starts_with: str) -> str:
    """Press the form's Send and wait for its answer to begin with `starts_with` (the status line)."""
    from playwright.sync_api import expect

    answer = form.locator(".answer")
    form.locator("button").click()
    expect(answer).to_contain_text(starts_with, timeout=ANSWER_TIMEOUT_MS)
    return answer.inner_text()


def test_try_it_submits_a_sample_and_shows_the_job_as_text(stack, browser_page):
    page = browser_page
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(stack.url("/docs"))

    submit = _form(page, "POST", "/v1/jobs")
    submit.locator('input[name="image"]').set_input_files(str(REPO_ROOT / "samples" / "shapes-3.jpg"))
    submit.locator('input[name="conf"]').fill("0.4")
    accepted = _send_and_read(submit, "202 ACCEPTED")
    assert accepted.startswith("202 ACCEPTED\nContent-Type: application/json\nLocation: "), accepted
    job_id = page.evaluate("document.querySelector('input[name=\"job_id\"]').value")
    assert len(job_id) == 32 and f'"id": "{job_id}"' in accepted, accepted

    read = _form(page, "GET", "/v1/jobs/{job_id}")
    assert read.locator('input[name="job_id"]').input_value() == job_id  # the page filled it in
    read.locator('input[name="wait"]').fill("20")
    done = _send_and_read(read, '"status": "succeeded"')
    assert done.startswith("200 OK\nContent-Type: application/json\n\n{"), done
    assert '"conf": 0.4' in done and '"label": "content"' in done, done
    assert errors == []


def test_an_answer_holding_html_stays_text(stack, browser_page):
    page = browser_page
    page.goto(stack.url("/docs"))
    before = page.evaluate(ELEMENTS)
    read = _form(page, "GET", "/v1/jobs/{job_id}")
    read.locator('input[name="job_id"]').fill(MARKUP)
    refused = _send_and_read(read, "404 NOT FOUND")
    assert "application/problem+json" in refused and MARKUP in refused, refused
    submit = _form(page, "POST", "/v1/jobs")
    submit.locator('input[name="image"]').set_input_files(str(REPO_ROOT / "samples" / "shapes-3.jpg"))
    submit.locator('input[name="conf"]').fill(MARKUP)
    refused = _send_and_read(submit, "400 BAD REQUEST")
    assert MARKUP in refused, refused
    after = page.evaluate(ELEMENTS)
    assert after == before and after["in_answers"] == 0 and after["images"] == 0, (before, after)
    assert page.evaluate("window.injected") is None
