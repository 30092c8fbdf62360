"""The terminal's foreground for `make run`'s supervisor: Ctrl-C reaches it alone, and `make` ends with 0.

A terminal's Ctrl-C signals its whole foreground process group: make, the run-local shell and the supervisor.
make, signalled, kills itself with SIGINT once its child has ended, whatever the child's status: every Ctrl-C
ended with `make: *** [Makefile:4: run] Error 130` and a status of 130. So the supervisor moves into a process
group of its own and makes it the terminal's foreground group while it runs: Ctrl-C signals it alone, it stops
everything, gives the terminal back, and make sees its child end with 0 after a clean stop.
"""

from __future__ import annotations

import os
import signal


class Foreground:
    def __init__(self) -> None:
        self.tty: int | None = None
        self.previous = 0

    def take(self) -> bool:
        """Whether it took the terminal: only one this process is in the foreground of (not in the background,
        not without a terminal: a service manager, a test, CI)."""
        try:
            tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
        except OSError:
            return False
        try:
            previous = os.tcgetpgrp(tty)
            if previous != os.getpgrp():
                os.close(tty)
                return False
            os.setpgid(0, 0)
            _set_foreground(tty, os.getpgrp())
        except OSError:
            os.close(tty)
            return False
        self.tty, self.previous = tty, previous
        return True

    def give_back(self) -> None:
        if self.tty is None:
            return
        try:
            _set_foreground(self.tty, self.previous)
        except OSError:
            pass  # that group is gone (make was killed): the shell takes its terminal back itself
        os.close(self.tty)
        self.tty = None


def _set_foreground(tty: int, group: int) -> None:
    """tcsetpgrp from a background group raises SIGTTOU, which would stop this process: ignored for the call."""
    before = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(tty, group)
    finally:
        signal.signal(signal.SIGTTOU, before)
