"""The API's gunicorn worker (app.server): what it changes in a gevent-patched process."""
from __future__ import annotations

import subprocess
import sys

from tests.support import REPO_ROOT

_READINESS = """
from gevent import monkey
monkey.patch_all()
import socket, time, gevent
from redis._parsers import hiredis as parser
from app.server import cheap_readiness_checks
cheap_readiness_checks()
a, b = socket.socketpair()
assert parser._socket_can_read(a, 0) is False            # idle: no stale reply
b.sendall(b"+OK\\r\\n")
assert parser._socket_can_read(a, 0) is True             # a reply waits
a.recv(16)
ticks = []
ticker = gevent.spawn(lambda: [ticks.append(gevent.sleep(0.01)) for _ in range(5)])
started = time.monotonic()
assert parser._socket_can_read(a, 0.2) is False           # a real wait still goes through gevent's poll...
assert time.monotonic() - started >= 0.15
assert len(ticks) >= 3, ticks                             # ...and lets other greenlets run meanwhile
print("ok")
"""


def test_zero_timeout_readiness_checks_skip_gevents_hub_and_real_waits_do_not():
    """redis-py's check before each command polls with a zero timeout: done without gevent's hub (it cannot
    block); a wait with a timeout (the long-polls' pub/sub listener) still yields to other greenlets."""
    result = subprocess.run([sys.executable, "-c", _READINESS], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
