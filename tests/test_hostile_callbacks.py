"""Hostile callback receivers (issue 40, finding 1): a receiver that sends its headers and then a byte every
second, one that trickles its headers, one that never answers, over http and https. An attempt ends at its
deadline whatever the receiver does, and one tenant's receivers hold its own slots, never another tenant's:
its callbacks wait in Redis while another's are delivered."""
from __future__ import annotations

import time

import pytest

from bench.hostile import Tarpit
from contract.callbacks import resolve_callback_url
from tasks.callbacks import DeliveryFailed, post_to
from tests.support import wait_until

DEADLINE_S = 3.0
MARGIN_S = 3.0        # what a busy 2-core machine may add to an attempt's end, beyond its deadline


@pytest.mark.parametrize("mode,scheme", [("trickle", "http"), ("trickle-headers", "http"), ("silent", "http"),
                                         ("silent", "https")])
def test_an_attempt_ends_at_its_deadline_whatever_the_receiver_does(mode, scheme):
    """Each read waited at most the timeout, so a byte a second held the attempt as long as the receiver cared
    to: 234 s in the probe. The tarpit would go on for a minute; the attempt ends at its deadline (here shorter
    than the timeout of each wait, so that only the deadline can end it)."""
    tarpit = Tarpit(mode, interval_s=1.0)
    target = resolve_callback_url(tarpit.url.replace("http", scheme, 1), ("127.0.0.1",))
    started = time.monotonic()
    try:
        with pytest.raises(DeliveryFailed, match=f"did not answer within {DEADLINE_S:g} s"):
            post_to(target, b"{}", {"Content-Type": "application/json"}, 10.0, 65536, deadline_s=DEADLINE_S)
        taken = time.monotonic() - started
        [visit] = wait_until(lambda: [v for v in tarpit.visits if v.closed is not None], 10,
                             what="the tarpit to see the attempt hang up")
    finally:
        tarpit.stop()
    assert DEADLINE_S - 0.1 <= taken < DEADLINE_S + MARGIN_S, taken
    assert visit.closed_by_client                        # the service hung up: the tarpit had a minute to go
    if mode == "trickle":
        assert visit.sent >= 1                           # it was mid-answer: headers sent, the body trickling

