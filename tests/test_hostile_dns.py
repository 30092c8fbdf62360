"""Issue 59, finding 1, as it was found: the API under gunicorn's gevent worker, its callback hosts resolved
through a name server that never answers. Before, each submission's lookup ran glibc's blocking resolver on the
event loop's own thread: with 4 of one key's in flight, /healthz took 10-20 s and another key's submission 40 s
(bench.hostile.dns). Now the lookups wait in threads of their own: /healthz and the other key answer at once,
the slow key's fifth is a 429, and its stuck ones end at the deadline with a 400 saying so.

The rig (bench.hostile.dns): a network namespace made here, the API and its redis-server inside, and
/etc/netns/<namespace>/resolv.conf naming a UDP socket of this process that reads queries and answers none. No
callback worker runs: nothing is ever posted. The namespace and /etc/netns/<namespace> are gone afterwards."""

from __future__ import annotations

import secrets
import subprocess
import threading
import time
from pathlib import Path

import pytest

from bench.hostile.dns import NETNS_ETC, silent_dns_api
from bench.stack.hosts import HostsUnavailable, check_can_make_hosts
from contract.documents import PROBLEM_TYPE
from tests.support import wait_until

LOOKUP_TIMEOUT_S = 5.0  # longer than the default 2 s: room to probe the API while the lookups are stuck
CAP = 4
FAST_S = 1.0
MARGIN_S = 1.5  # what a busy 2-core machine may add to the deadline


@pytest.fixture
def can_make_hosts():
    try:
        check_can_make_hosts()
    except HostsUnavailable as exc:
        pytest.skip(str(exc))


def test_lookups_stuck_on_a_silent_name_server_cost_their_own_key_not_the_process(can_make_hosts, tmp_path: Path):
    tag = secrets.token_hex(3)
    names = [f"hook-{n}.{tag}.example" for n in range(CAP)]
    stuck: list[tuple[int, float, dict]] = []
    callbacks = {"lookup_timeout_s": LOOKUP_TIMEOUT_S, "max_lookups_per_key": CAP}
    with silent_dns_api(tmp_path, callbacks=callbacks) as rig:
        namespace = rig.host.namespace
        assert (NETNS_ETC / namespace / "resolv.conf").read_text() == f"nameserver {rig.host.network.gateway}\n"
        threads = [
            threading.Thread(target=lambda name=name: stuck.append(rig.submit("slow", f"http://{name}/hook")))
            for name in names
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        # Each stuck submission's host asked of the silent name server: every lookup is under way.
        wait_until(lambda: set(names) <= rig.dns.names, LOOKUP_TIMEOUT_S, what="every name at the name server")

        over_status, over_taken, over = rig.submit("slow", f"http://hook-{CAP}.{tag}.example/hook")
        probes = []
        for n in range(3):
            healthz = rig.healthz()
            status, taken, _ = rig.submit("other", None if n % 2 else "http://127.0.0.1:9/hook")
            probes.append((healthz, status, taken))
        probed_by = time.monotonic() - started
        for thread in threads:
            thread.join(LOOKUP_TIMEOUT_S + 30)
        log = rig.api.log_tail()
    assert probed_by < LOOKUP_TIMEOUT_S, probed_by  # every probe while the lookups were stuck
    # The API answered at once: /healthz, and the other key's submissions (with and without a callback).
    assert all(healthz < FAST_S and status == 202 and taken < FAST_S for healthz, status, taken in probes), probes
    # The slow key past its cap: refused at once, without a lookup.
    assert (over_status, over["type"], over["_headers"]["Content-Type"]) == (
        429,
        "/problems/callback-lookups-over-limit",
        PROBLEM_TYPE,
    ), over
    assert over_taken < FAST_S and int(over["_headers"]["Retry-After"]) >= 1
    assert f"hook-{CAP}.{tag}.example" not in rig.dns.names
    # The stuck ones: at the deadline, a 400 that says why.
    reason = f"its host did not resolve within {LOOKUP_TIMEOUT_S:g} s (its name server did not answer in time)"
    assert len(stuck) == CAP, log
    for status, taken, body in stuck:
        assert status == 400 and body["invalid_params"] == [{"name": "callback_url", "reason": reason}], body
        assert LOOKUP_TIMEOUT_S - 0.1 <= taken < LOOKUP_TIMEOUT_S + MARGIN_S, taken
    # Nothing left behind: the namespace and its resolv.conf.
    assert namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not (NETNS_ETC / namespace).exists()
