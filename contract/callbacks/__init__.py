"""What the API and the callback worker share about callbacks: which URLs may be called, and which
secret signs a job's callbacks.

Safety. The URL is parsed strictly, by this module's own grammar, not by a
library that might read it differently from the one that connects: only
`http(s)://host[:port][/path][?query]` in printable ASCII, with no userinfo
(`user@`), no backslash, no fragment, and an IP address only in its canonical
form (dotted decimal, or bracketed IPv6; decimal, octal and hex forms of an
address are refused). The host is resolved once; every address it resolves to
must be public (not loopback, private, link-local or cloud metadata, shared,
multicast, reserved, in an IANA special-purpose block (contract.callbacks.special_addresses), nor an IPv6 form
embedding one of those) unless
`callbacks.allow_hosts` admits it; then the connection goes to that checked
address, never to a second lookup (no DNS rebinding), with the URL's host in
the Host header and, for https, in SNI and the certificate check. Checked at
submit and again at each delivery. Bounded timeouts and response size; no
redirects; no proxies from the environment.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from contract.callbacks.special_addresses import denied_block, embedded_ipv4
from contract.jobs.record import utc_iso
from contract.settings import Settings
from contract.settings.check_secrets import check_secret
from contract.settings.sections import SettingsError

_URL = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::(?P<port>[0-9]{1,5}))?"
    r"(?P<path>/[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*)?(?P<query>\?[A-Za-z0-9\-._~!$&'()*+,;=:@/%?]*)?"
)
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_NUMBER = re.compile(r"(0[xX][0-9A-Fa-f]*|[0-9]+)")


# What a client reads when its URL's host is refused after the lookup, whatever the lookup said: the reason
# ("'vm' resolves to 127.0.0.1", "does not resolve") told a client what internal names resolve to.
REFUSED_HOST = (
    "callback_url's host is not one this service may call: it must resolve, and only to public "
    "addresses, unless the deployment admits it"
)


# getaddrinfo's signature: (host, port, family=0, type=0, proto=0, flags=0) -> [(family, type, proto, name, address)]
Resolver = Callable[..., list[Any]]


class CallbackRefused(ValueError):
    """A callback URL the service will not call. str() is the whole reason (for the log); `public` is what the
    client may read: the same for what the URL's text alone decides, REFUSED_HOST for what the lookup found."""

    def __init__(self, reason: str, public: str | None = None) -> None:
        super().__init__(reason)
        self.public = public or reason


@dataclass(frozen=True)
class CallbackUrl:
    scheme: str  # http | https
    host: str  # as written, lower case; an IPv6 address without its brackets
    port: int
    target: str  # path and query: what the request line asks for

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.scheme == "https" else 80) else f"{host}:{self.port}"


@dataclass(frozen=True)
class CallbackTarget:
    url: CallbackUrl
    address: str  # the address that passed the check: the one the delivery connects to


def parse_callback_url(url: str) -> CallbackUrl:
    """The URL by this module's grammar (see the module's note), or CallbackRefused."""
    if not isinstance(url, str) or not url.isascii() or not url.isprintable() or " " in url:
        raise CallbackRefused("callback_url must be printable ASCII without spaces (IDN hosts in their xn-- form)")
    if "\\" in url:
        raise CallbackRefused("callback_url must not contain a backslash")
    authority = url.partition("://")[2].partition("/")[0].partition("?")[0]
    if "@" in authority:
        raise CallbackRefused("callback_url must not carry credentials (user@host)")
    match = _URL.fullmatch(url)
    if match is None:
        raise CallbackRefused("callback_url must be http(s)://host[:port][/path][?query], with no user@ and no #")
    scheme = match["scheme"].lower()
    if scheme not in ("http", "https"):
        raise CallbackRefused("callback_url must be an http or https URL")
    host = _checked_host(match["host"])
    port = int(match["port"]) if match["port"] else (443 if scheme == "https" else 80)
    if not 1 <= port <= 65535:
        raise CallbackRefused(f"callback_url's port {port} is out of range")
    target = (match["path"] or "/") + (match["query"] or "")
    return CallbackUrl(scheme, host, port, target)


def _checked_host(host: str) -> str:
    if host.startswith("["):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError as exc:
            raise CallbackRefused(f"callback_url's host {host} is not an IPv6 address") from exc
    host = host.lower()
    labels = host.split(".")
    if all(_NUMBER.fullmatch(label) for label in labels):  # an address: only the canonical dotted form
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            address = None
        if address is None or str(address) != host:
            raise CallbackRefused(
                f"callback_url's host {host!r} is a number that is not a dotted-decimal "
                "IPv4 address (decimal, octal and hex forms are refused)"
            )
        return host
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise CallbackRefused(f"callback_url's host {host!r} is not a valid DNS name")
    return host


def forbidden_reason(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why a callback must not reach this address, or None if it is a public one: in an IANA special-purpose
    block (contract.callbacks.special_addresses, whatever `is_global` says), or not global, multicast, reserved,
    unspecified, loopback or link-local by `ipaddress`. IPv6 forms that carry an IPv4 address (mapped, 6to4,
    Teredo, NAT64) are judged by that address too."""
    candidates = (address, *embedded_ipv4(address))
    for candidate in candidates:
        block = denied_block(candidate)
        if block is not None:
            carried = "" if candidate == address else f" (it carries {candidate})"
            return f"{address}{carried}, an address of the special-purpose block {block}"
    for candidate in candidates:
        if (
            not candidate.is_global
            or candidate.is_multicast
            or candidate.is_reserved
            or candidate.is_unspecified
            or candidate.is_loopback
            or candidate.is_link_local
        ):
            return f"{address}, a loopback, private, link-local, shared or reserved address"
    return None


def resolve_callback_url(url: str, allow_hosts: Iterable[str] = (), resolve: Resolver | None = None) -> CallbackTarget:
    """Parse, resolve once, check every address; the target to connect to (CallbackRefused otherwise).
    `resolve`: getaddrinfo's signature; by default `socket.getaddrinfo` as it is at the call (gevent's once the
    API's worker patched it), never the one there was when this module was imported. The API passes
    its own (app.callback_lookups: off the event loop, within a deadline); a `resolve` may raise CallbackRefused
    itself, which is passed on as it is. A literal address is not looked up."""
    parsed = parse_callback_url(url)
    entries = [allow_entry(entry) for entry in allow_hosts]
    at_port = [where for where, port in entries if port is None or port == parsed.port]
    allowed = [where for where in at_port if not _is_network(where)]
    networks = [ipaddress.ip_network(where, strict=False) for where in at_port if _is_network(where)]
    addresses = _literal(parsed.host) or _looked_up(parsed, socket.getaddrinfo if resolve is None else resolve)
    if not addresses:
        raise CallbackRefused(f"callback host {parsed.host!r} resolves to no address", REFUSED_HOST)
    for address in addresses:
        if parsed.host in allowed or any(address in network for network in networks):
            continue
        reason = forbidden_reason(address)
        if reason:
            raise CallbackRefused(
                f"callback host {parsed.host!r} resolves to {reason} (allow it with callbacks.allow_hosts)",
                REFUSED_HOST,
            )
    return CallbackTarget(parsed, str(addresses[0]))


def _literal(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        return []


def _looked_up(parsed: CallbackUrl, resolve: Resolver) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = resolve(parsed.host, parsed.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except CallbackRefused:
        raise
    except (OSError, ValueError) as exc:
        raise CallbackRefused(f"callback host {parsed.host!r} does not resolve: {exc}", REFUSED_HOST) from exc
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def allow_entry(entry: str) -> tuple[str, int | None]:
    """A callbacks.allow_hosts entry as (host or network, port or None for any): `hooks.internal`,
    `10.0.0.0/8`, `127.0.0.1:8080`, `hooks.internal:443`, `[fd00::/8]:8443` (an IPv6 one with a port in
    brackets). A port admits that port only: an allowed loopback host is not every local service."""
    text = entry.strip().lower()
    try:
        if text.startswith("["):
            inner, _, rest = text[1:].partition("]")
            return inner, int(rest[1:]) if rest.startswith(":") else None
        if text.count(":") == 1:
            where, _, port = text.partition(":")
            return where, int(port)
    except ValueError as exc:
        raise SettingsError(f"callbacks.allow_hosts entry {entry!r}: its port is not a number") from exc
    return text, None


def check_callback_url(url: str, allow_hosts: Iterable[str] = (), resolve: Resolver | None = None) -> None:
    resolve_callback_url(url, allow_hosts, resolve)


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
        return True
    except ValueError:
        return False


def callback_secret(settings: Settings, owner: str | None) -> str | None:
    """The secret that signs this job's callbacks: its API key's own; the deployment's only when it
    has no keys. None: callbacks are not available to this client."""
    if not settings.auth.api_keys:
        return settings.callbacks.secret or None
    for entry in settings.auth.api_keys:
        if str(entry["id"]) == owner:
            return key_callback_secret(entry)
    return None


def key_callback_secret(entry: Mapping[str, Any]) -> str | None:
    """An API key's callback secret, from the environment variable or the file its entry names."""
    if entry.get("callback_secret_env"):
        secret = os.environ.get(str(entry["callback_secret_env"]), "")
    elif entry.get("callback_secret_file"):
        try:
            with open(str(entry["callback_secret_file"]), encoding="utf-8") as handle:
                secret = handle.read().strip()
        except OSError as exc:
            raise SettingsError(f"API key {entry['id']!r}: cannot read its callback secret: {exc}") from exc
    else:
        return None
    check_secret(f"API key {entry['id']!r}'s callback secret", secret)
    return secret


def callback_document(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job's stored callback state as its document shows it: its moment as ISO 8601, as the job's others (the
    stored state keeps unix seconds: the redelivery step compares them with the clock)."""
    if not state:
        return {"status": "waiting", "attempts": 0, "last_error": None}
    shown = dict(state)
    due = shown.get("next_attempt_at")
    if isinstance(due, int | float):
        shown["next_attempt_at"] = utc_iso(due)
    return shown
