"""A command run on a terminal of its own, as a person runs it, for checks of what a terminal does: Ctrl-C
is the ^C character typed, which the terminal turns into SIGINT for its foreground process group (not a signal
sent to a group the check chose). The output is read as it comes (a terminal's buffer is small) into a log."""

from __future__ import annotations

import fcntl
import os
import pty
import subprocess
import termios
import threading
from pathlib import Path


def _controlling_terminal() -> None:
    """In the child, a session leader already (start_new_session): its stdin, the terminal, becomes its
    controlling terminal, and its process group the terminal's foreground group, as a shell's job would be."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class TerminalSession:
    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> None:
        master, slave = pty.openpty()
        self.master = master
        self.log_path = log_path
        log_path.touch()  # there to read from the start, as the output comes
        self.process = subprocess.Popen(
            argv,
            cwd=cwd,
            env={**env, "TERM": env.get("TERM", "dumb")},
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=_controlling_terminal,
        )
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        with open(self.log_path, "ab") as log:
            while True:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: every process holding the terminal has ended
                    return
                if not chunk:
                    return
                log.write(chunk.replace(b"\r\n", b"\n"))
                log.flush()

    def type_ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def wait(self, timeout_s: float) -> int:
        status = self.process.wait(timeout_s)
        self.reader.join(5)
        return status

    def close(self) -> None:
        try:
            os.close(self.master)
        except OSError:
            pass
