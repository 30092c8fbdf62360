"""Issue 59, finding 5: the callback address rule trusted `ipaddress.is_global`, which on Python 3.11.7 calls
some IANA special-purpose blocks global (192.0.0.192, a cloud metadata address; 192.88.99.0/24; fec0::/10).
Every block of the registries is now refused by an explicit list. Checked address by address in this process
(the rule itself, and a resolve with a fake lookup) and at the API's answer with no callback worker running:
nothing is ever sent to any of these addresses."""

from __future__ import annotations

import ipaddress
import socket

import pytest
import requests
import yaml

from contract.callbacks import REFUSED_HOST, CallbackRefused, forbidden_reason, resolve_callback_url
from contract.callbacks.special_addresses import DENIED_V4, DENIED_V6, denied_block, embedded_ipv4
from tests.support import ApiServer, jpeg

# The blocks the review named, each of which must be in the list (more of the registries' are there too).
NAMED = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.0.0.0/24",
    "192.0.2.0/24", "192.31.196.0/24", "192.52.193.0/24", "192.88.99.0/24", "192.168.0.0/16", "192.175.48.0/24",
    "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32",
    "::/128", "::1/128", "64:ff9b:1::/48", "100::/64", "2001::/23", "2001:db8::/32", "fc00::/7", "fe80::/10",
    "fec0::/10", "ff00::/8",
]  # fmt: skip

# What is_global on Python 3.11.7 calls global in those blocks: the addresses the review found.
GLOBAL_BY_PYTHON = [
    "192.0.0.192", "192.0.0.9", "192.0.0.255", "192.88.99.1", "192.31.196.1", "192.52.193.1", "192.175.48.1",
    "fec0::1", "feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "2620:4f:8000::1", "3fff::1",
]  # fmt: skip

# Forms that carry an IPv4 address: judged by it.
CARRYING = {
    "::ffff:192.0.0.192": "192.0.0.192",  # IPv4-mapped
    "64:ff9b::c000:c0": "192.0.0.192",  # NAT64's well-known prefix
    "2002:c000:c0::1": "192.0.0.192",  # 6to4
    "2002:c058:6301::1": "192.88.99.1",
    "2002:7f00:1::1": "127.0.0.1",
}


def sample(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> list[str]:
    """The block's first, last and middle addresses."""
    first, last = int(network.network_address), int(network.broadcast_address)
    kind = ipaddress.IPv4Address if network.version == 4 else ipaddress.IPv6Address
    return [str(kind(value)) for value in sorted({first, (first + last) // 2, last})]


EVERY_BLOCK = [(str(network), address) for network, _ in (*DENIED_V4, *DENIED_V6) for address in sample(network)]


def test_the_list_holds_every_block_the_review_named():
    listed = {str(network) for network, _ in (*DENIED_V4, *DENIED_V6)}
    assert set(NAMED) <= listed, set(NAMED) - listed


@pytest.mark.parametrize("block,address", EVERY_BLOCK)
def test_every_address_of_every_special_block_is_refused(block, address):
    parsed = ipaddress.ip_address(address)
    assert denied_block(parsed) is not None
    reason = forbidden_reason(parsed)
    assert reason is not None and address in reason


@pytest.mark.parametrize("address", GLOBAL_BY_PYTHON)
def test_addresses_python_calls_global_are_refused(address):
    parsed = ipaddress.ip_address(address)
    reason = forbidden_reason(parsed)
    assert reason is not None and "special-purpose block" in reason, reason


@pytest.mark.parametrize("address,carried", CARRYING.items())
def test_ipv6_forms_are_judged_by_the_ipv4_address_they_carry(address, carried):
    parsed = ipaddress.ip_address(address)
    assert ipaddress.IPv4Address(carried) in embedded_ipv4(parsed)
    reason = forbidden_reason(parsed)
    assert reason is not None and carried in reason, reason


@pytest.mark.parametrize("address", ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111", "2002:5db8:d822::1"])
def test_public_addresses_still_pass(address):
    """Checked in this process only: nothing is sent to them."""
    assert forbidden_reason(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize("address", ["192.0.0.192", "192.88.99.7", "fec0::1", "2001:db8::1", "198.18.0.1"])
def test_a_name_that_resolves_into_a_special_block_is_refused_with_the_one_generic_answer(address):
    calls: list[str] = []

    def resolve(host: str, port: int, **_: object) -> list:
        calls.append(host)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port))]

    with pytest.raises(CallbackRefused) as refused:
        resolve_callback_url("https://hooks.example.com/hook", (), resolve=resolve)
    assert calls == ["hooks.example.com"] and refused.value.public == REFUSED_HOST
    assert "special-purpose block" in str(refused.value)


@pytest.fixture(scope="module")
def api_without_workers(redis_server, tmp_path_factory):
    """An API on the test's Redis, in a namespace no callback worker (nor any other) serves."""
    from app import create_app
    from contract.settings.config import load_settings

    workdir = tmp_path_factory.mktemp("special-addresses")
    config = {
        "redis_url": redis_server.url,
        "namespace": "special59",
        "callbacks": {"secret": "special-addresses-callback-secret"},
        "cache": {"enabled": False},
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    server = ApiServer(create_app(load_settings(workdir / "config.yaml")))
    yield server
    server.stop()


@pytest.mark.parametrize("host", ["192.0.0.192", "192.88.99.1", "192.31.196.53", "[fec0::1]", "[2002:c000:c0::1]"])
def test_the_api_refuses_a_literal_special_address_with_no_worker_running(api_without_workers, host):
    response = requests.post(
        api_without_workers.url + "/v1/jobs",
        params={"callback_url": f"http://{host}/latest/meta-data"},
        data=jpeg(32, 32),
        headers={"Content-Type": "image/jpeg"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["invalid_params"] == [{"name": "callback_url", "reason": REFUSED_HOST}]
