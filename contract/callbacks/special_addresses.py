"""The IANA special-purpose address blocks a callback may never reach, listed here rather than trusted to
`ipaddress`'s `is_global`: on Python 3.11.7 that calls 192.0.0.192 (a cloud metadata address in SSRF
references), 192.88.99.0/24, the AS112 and AMT blocks and IPv6 site-local fec0::/10 "global".

The blocks are those of the IANA IPv4 and IPv6 Special-Purpose Address Registries (and multicast, reserved and
limited broadcast), each refused whole, even where the registry calls a small part of it globally reachable
(an anycast service in 192.0.0.0/24 or 2001::/23 is no callback receiver). IPv6 forms that carry an IPv4
address (IPv4-mapped ::ffff:0:0/96, the NAT64 well-known prefix 64:ff9b::/96, 6to4 2002::/16, Teredo) are
also judged by that IPv4 address: `embedded_ipv4`. Used in addition to `is_global` (contract.callbacks).
"""

from __future__ import annotations

import ipaddress
from typing import Final

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

DENIED_V4: Final[tuple[tuple[ipaddress.IPv4Network, str], ...]] = tuple(
    (ipaddress.IPv4Network(block), what)
    for block, what in (
        ("0.0.0.0/8", "this network"),
        ("10.0.0.0/8", "private-use"),
        ("100.64.0.0/10", "shared address space"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local (cloud metadata)"),
        ("172.16.0.0/12", "private-use"),
        ("192.0.0.0/24", "IETF protocol assignments (192.0.0.192: cloud metadata)"),
        ("192.0.2.0/24", "documentation (TEST-NET-1)"),
        ("192.31.196.0/24", "AS112-v4"),
        ("192.52.193.0/24", "AMT"),
        ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
        ("192.168.0.0/16", "private-use"),
        ("192.175.48.0/24", "direct delegation AS112 service"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation (TEST-NET-2)"),
        ("203.0.113.0/24", "documentation (TEST-NET-3)"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("255.255.255.255/32", "limited broadcast"),
    )
)

DENIED_V6: Final[tuple[tuple[ipaddress.IPv6Network, str], ...]] = tuple(
    (ipaddress.IPv6Network(block), what)
    for block, what in (
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "local-use IPv4/IPv6 translation"),
        ("100::/64", "discard-only"),
        ("100:0:0:1::/64", "dummy IPv6 prefix"),
        ("2001::/23", "IETF protocol assignments (Teredo, ORCHID, AS112, ...)"),
        ("2001:db8::/32", "documentation"),
        ("2620:4f:8000::/48", "direct delegation AS112 service"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "segment routing (SRv6) SIDs"),
        ("fc00::/7", "unique local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
    )
)

# The blocks whose addresses carry an IPv4 address, judged by it as well.
IPV4_MAPPED: Final = ipaddress.IPv6Network("::ffff:0:0/96")
NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")
SIX_TO_FOUR: Final = ipaddress.IPv6Network("2002::/16")


def denied_block(address: Address) -> str | None:
    """`"<block> (<what it is>)"` for the special-purpose block that holds `address`, or None."""
    table = DENIED_V4 if isinstance(address, ipaddress.IPv4Address) else DENIED_V6
    for network, what in table:
        if address in network:
            return f"{network} ({what})"
    return None


def embedded_ipv4(address: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries: IPv4-mapped, 6to4, Teredo (server and client), NAT64's
    well-known prefix. None for an IPv4 address."""
    if isinstance(address, ipaddress.IPv4Address):
        return []
    carried = [v4 for v4 in (address.ipv4_mapped, address.sixtofour) if v4 is not None]
    carried += list(address.teredo or ())
    if address in NAT64:
        carried.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return carried
