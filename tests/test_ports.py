"""tools.ports: make run looks at every port before it starts anything (issue 53: a busy one was 80 lines up)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.support import REPO_ROOT, free_port
from tools.ports import Listener, check


def test_a_busy_port_is_one_line_naming_it_its_holder_and_the_variable_with_a_free_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "tools.ports", f"the API=0.0.0.0:{port}=IMGSERVE_API__BIND"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith(
        f"make run: not starting: port {port} (the API, 0.0.0.0:{port}) is in use by pid {os.getpid()} ("
    )
    assert (
        f"move it with IMGSERVE_API__BIND=0.0.0.0:{port + 1}" in line
        or "move it with IMGSERVE_API__BIND=0.0.0.0:" in line
    )


def test_free_ports_pass_and_one_port_named_twice_does_not():
    api, flower = free_port(), free_port()
    assert (
        check(
            [
                Listener("the API", "127.0.0.1", api, "IMGSERVE_API__BIND"),
                Listener("Flower", "127.0.0.1", flower, "FLOWER_PORT"),
            ]
        )
        == []
    )
    [line] = check(
        [
            Listener("the API", "127.0.0.1", api, "IMGSERVE_API__BIND"),
            Listener("Flower", "127.0.0.1", api, "FLOWER_PORT"),
        ]
    )
    assert line == f"port {api} is named for both the API (IMGSERVE_API__BIND) and Flower (FLOWER_PORT): move one"
