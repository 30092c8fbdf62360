"""Issue 59, finding 1, in this process: the resolver is looked up at each call (contract.callbacks had bound
`socket.getaddrinfo` as a default argument at import: the gunicorn master's, before gevent patched it), and the
API's lookups (app.callback_lookups) run in threads of their own, end at their deadline with a clear refusal,
and count against the key that asked until the resolver itself gives up. The same through gunicorn's gevent
worker and a name server that never answers: tests/test_hostile_dns.py."""

from __future__ import annotations

import inspect
import socket
import threading
import time

import pytest

from app.callback_lookups import CallbackLookups, native_getaddrinfo
from app.problems import Problem
from contract import callbacks
from contract.callbacks import CallbackRefused, check_callback_url, resolve_callback_url
from tests.support import wait_until


def answer(address: str):
    def resolve(host, port, **_):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    return resolve


def test_the_contract_looks_the_resolver_up_at_each_call_not_at_import(monkeypatch):
    for function in (resolve_callback_url, check_callback_url):
        assert inspect.signature(function).parameters["resolve"].default is None  # nothing bound at import
    asked: list[str] = []

    def patched(host, port, **kwargs):  # what gevent's patch of the socket module does after the import
        asked.append(host)
        return answer("93.184.216.34")(host, port, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", patched)
    target = resolve_callback_url("https://hooks.example.com/x", ())
    assert asked == ["hooks.example.com"] and target.address == "93.184.216.34"


def test_no_function_on_the_callback_path_binds_a_resolver_as_a_default():
    import app.callback_lookups
    import app.submission
    import tasks.callbacks.http_client

    bound = [
        f"{module.__name__}.{name}({parameter.name})"
        for module in (callbacks, app.callback_lookups, app.submission, tasks.callbacks.http_client)
        for name, function in inspect.getmembers(module, inspect.isfunction)
        for parameter in inspect.signature(function).parameters.values()
        if callable(parameter.default) and "getaddrinfo" in getattr(parameter.default, "__name__", "")
    ]
    assert bound == []


def test_the_apis_lookups_use_the_resolver_there_is_at_the_call(monkeypatch):
    asked: list[str] = []

    def patched(host, port, **kwargs):
        asked.append(host)
        return answer("93.184.216.34")(host, port, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", patched)
    assert native_getaddrinfo() is patched  # not patched by gevent here: the module's attribute, as it is now
    lookups = CallbackLookups(timeout_s=5.0, per_key=2, threads=4)
    target = resolve_callback_url("http://hooks.example.com/x", (), lookups.resolver("key-a"))
    assert target.address == "93.184.216.34" and asked == ["hooks.example.com"]
    wait_until(lambda: lookups.in_flight() == 0, 5, what="the slot back")


def test_a_literal_address_is_never_looked_up():
    def no_lookup(host, port, **_):
        raise AssertionError(f"looked {host!r} up")

    target = resolve_callback_url("http://127.0.0.1:9/hook", ("127.0.0.1:9",), no_lookup)
    assert target.address == "127.0.0.1"


@pytest.fixture
def stuck_resolver(monkeypatch):
    """socket.getaddrinfo as a name server that never answers: each call waits until the test lets it go."""
    release = threading.Event()
    waiting: list[str] = []

    def never_answers(host, port, **_):
        waiting.append(host)
        release.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", never_answers)
    yield waiting
    release.set()


def test_a_stuck_lookup_ends_at_its_deadline_and_holds_its_keys_slot_until_the_resolver_gives_up(stuck_resolver):
    lookups = CallbackLookups(timeout_s=0.5, per_key=2, threads=8)
    started = time.monotonic()
    with pytest.raises(CallbackRefused) as refused:
        check_callback_url("http://stuck.example/hook", (), lookups.resolver("key-a"))
    taken = time.monotonic() - started
    assert 0.45 <= taken < 2.0, taken
    assert refused.value.public == "its host did not resolve within 0.5 s (its name server did not answer in time)"
    assert stuck_resolver == ["stuck.example"]
    assert lookups.in_flight("key-a") == 1  # its thread still waits on the name server: still the key's


def test_past_its_cap_a_key_gets_429_and_another_key_is_unaffected(stuck_resolver, monkeypatch):
    lookups = CallbackLookups(timeout_s=0.3, per_key=2, threads=8)
    for n in range(2):
        with pytest.raises(CallbackRefused):
            check_callback_url(f"http://stuck-{n}.example/hook", (), lookups.resolver("key-a"))
    started = time.monotonic()
    with pytest.raises(Problem) as over:
        check_callback_url("http://stuck-2.example/hook", (), lookups.resolver("key-a"))
    assert time.monotonic() - started < 0.2  # at once: no thread, no wait
    assert (over.value.status, over.value.slug, over.value.headers) == (
        429,
        "callback-lookups-over-limit",
        {"Retry-After": "1"},
    )
    assert len(stuck_resolver) == 2  # the third was never asked
    # Another key's lookup has threads of its own: it is answered (here by a prompt resolver).
    monkeypatch.setattr(socket, "getaddrinfo", answer("93.184.216.34"))
    assert resolve_callback_url("http://fine.example/", (), lookups.resolver("key-b")).address == "93.184.216.34"


def test_the_process_wide_bound_is_a_503(stuck_resolver):
    lookups = CallbackLookups(timeout_s=0.2, per_key=2, threads=3)
    for n, key in enumerate(("key-a", "key-a", "key-b")):
        with pytest.raises(CallbackRefused):
            check_callback_url(f"http://stuck-{n}.example/hook", (), lookups.resolver(key))
    with pytest.raises(Problem) as busy:
        check_callback_url("http://stuck-3.example/hook", (), lookups.resolver("key-c"))
    assert busy.value.status == 503 and busy.value.slug == "callback-lookups-busy"


def test_a_slot_comes_back_when_the_resolver_gives_up(monkeypatch):
    release = threading.Event()

    def slow_then_fails(host, port, **_):
        release.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", slow_then_fails)
    lookups = CallbackLookups(timeout_s=0.2, per_key=1, threads=2)
    with pytest.raises(CallbackRefused):
        check_callback_url("http://slow.example/hook", (), lookups.resolver("key-a"))
    assert lookups.in_flight("key-a") == 1
    release.set()
    wait_until(lambda: lookups.in_flight("key-a") == 0, 10, what="the key's slot back")
    monkeypatch.setattr(socket, "getaddrinfo", answer("93.184.216.34"))
    assert resolve_callback_url("http://slow.example/", (), lookups.resolver("key-a")).address == "93.184.216.34"
