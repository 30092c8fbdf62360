"""tools.procfile: what `make run` runs the Procfile with (real processes: small shell commands)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.procfile import parse_env, parse_procfile

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_procfile_lines_in_order_and_comments_skipped() -> None:
    text = "# the service\napi: gunicorn app\n\ncpu-worker:   celery -A tasks.worker worker -Q a,b\n"
    assert parse_procfile(text) == {"api": "gunicorn app", "cpu-worker": "celery -A tasks.worker worker -Q a,b"}
    assert list(parse_procfile(text)) == ["api", "cpu-worker"]


@pytest.mark.parametrize("text", ["api gunicorn", "api:", "a b: c", "api: one\napi: two"])
def test_malformed_procfiles_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_procfile(text)


def test_the_repository_procfile_parses() -> None:
    assert {"api", "cpu-worker", "gpu-worker", "flower", "callback-worker"} <= set(
        parse_procfile((REPO_ROOT / "Procfile").read_text())
    )


def test_env_file_values() -> None:
    text = (
        '# comment\nPLAIN=a b\nexport EXPORTED=1\nSINGLE=\'x \\n y\'\nDOUBLE="x\\ny \\"q\\""\n'
        "EMPTY=\nnot a line\n  SPACED = no\n"
    )
    assert parse_env(text) == {"PLAIN": "a b", "EXPORTED": "1", "SINGLE": "x \\n y", "DOUBLE": 'x\ny "q"', "EMPTY": ""}


def _start(tmp_path: Path, procfile: str, env_file: str | None = None, *options: str) -> subprocess.Popen:
    (tmp_path / "Procfile").write_text(procfile)
    if env_file is not None:
        (tmp_path / ".env").write_text(env_file)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tools.procfile", str(tmp_path / "Procfile"), *options],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): it has ended all the same.
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"


def _wait_for(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_output_is_the_processes_own_and_the_first_to_end_stops_the_rest(tmp_path: Path) -> None:
    pids = tmp_path / "sleeper.pid"
    supervisor = _start(
        tmp_path,
        f"talker: until [ -s {pids} ]; do sleep 0.05; done; "
        f'echo \'{{"role": "talker"}}\'; exit 3\n'
        f"sleeper: echo $$ > {pids}; exec sleep 60\n",
    )
    out, err = supervisor.communicate(timeout=30)
    assert supervisor.returncode == 3
    assert out == '{"role": "talker"}\n'  # as written, no prefix added
    assert "talker stopped (status 3)" in err and "sent SIGTERM to sleeper" in err
    assert not _alive(int(pids.read_text()))


def test_env_file_under_the_environment(tmp_path: Path) -> None:
    """As compose reads .env: a variable the environment sets wins. Over it, a copied .env.example's
    FLOWER_BASIC_AUTH undid the credentials make run had made and printed (issue 53)."""
    os.environ["SET_HERE"] = "environment"
    try:
        supervisor = _start(
            tmp_path, 'show: echo "$FROM_DOTENV $SET_HERE"\n', env_file='FROM_DOTENV=dotenv\nSET_HERE="dotenv"\n'
        )
    finally:
        del os.environ["SET_HERE"]
    out, _ = supervisor.communicate(timeout=30)
    assert out == "dotenv environment\n" and supervisor.returncode == 0


def test_the_ready_message_comes_from_the_environment_and_goes_no_further(tmp_path: Path) -> None:
    """make run's ready line names Flower's password: it was a command-line argument, in `ps -ef` for anyone."""
    os.environ["PROCFILE_READY_MESSAGE"] = "ready: secret-in-the-message"
    try:
        supervisor = _start(
            tmp_path,
            'show: echo "child sees [${PROCFILE_READY_MESSAGE:-nothing}]"; exec sleep 60\n',
            None,
            "--ready-url",
            "http://127.0.0.1:9/never",
        )
    finally:
        del os.environ["PROCFILE_READY_MESSAGE"]
    try:
        assert supervisor.stdout is not None
        assert supervisor.stdout.readline() == "child sees [nothing]\n"
        assert b"secret-in-the-message" not in Path(f"/proc/{supervisor.pid}/cmdline").read_bytes()
    finally:
        supervisor.send_signal(signal.SIGTERM)
        supervisor.communicate(timeout=30)


def test_sigterm_stops_every_process_group_children_included(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    # The process's own child (as gunicorn's and Celery's workers are) is in its group and goes too.
    supervisor = _start(tmp_path, f"parent: sleep 60 & echo $! > {child_pid}; wait\nother: exec sleep 60\n")
    child = int(_wait_for(child_pid))
    supervisor.send_signal(signal.SIGTERM)
    _, err = supervisor.communicate(timeout=30)
    assert supervisor.returncode == 0  # a clean stop
    assert "SIGTERM received" in err
    assert not _alive(child)
    # Ended by the SIGTERM it was sent: said as the clean stop it is, not as `stopped (status -15)` (issue 60).
    assert "parent stopped cleanly" in err and "other stopped cleanly" in err, err
    assert "status -15" not in err, err


def test_a_stop_that_had_to_kill_is_not_a_clean_one(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = _start(
        tmp_path,
        f"stubborn: trap '' TERM; echo up > {ready}; while true; do sleep 0.1; done\n",
        None,
        "--kill-wait-s",
        "1",
    )
    _wait_for(ready)
    supervisor.send_signal(signal.SIGINT)
    _, err = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 130 and "sent SIGKILL to stubborn" in err
    assert "stubborn stopped (killed: still running 1 s after SIGTERM)" in err and "cleanly" not in err, err


def test_a_process_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = _start(
        tmp_path,
        f"stubborn: trap '' TERM; echo up > {ready}; while true; do sleep 0.1; done\nquick: sleep 0.5; exit 0\n",
        None,
        "--kill-wait-s",
        "1",
    )
    _wait_for(ready)
    _, err = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0
    assert "sent SIGKILL to stubborn" in err


def test_it_waits_for_a_process_still_shutting_down_after_its_shell_ended(tmp_path: Path) -> None:
    """SIGTERM ends the `sh -c` at once; the process it started may take a while (a Celery worker finishing
    its tasks), and whoever stopped the supervisor then stops what that process still needs (Redis)."""
    ready, done = tmp_path / "ready", tmp_path / "done"
    supervisor = _start(
        tmp_path,
        f'slow: sh -c \'trap "sleep 1; echo done > {done}; exit 0" TERM; '
        f"echo up > {ready}; while true; do sleep 0.1; done'\n",
    )
    _wait_for(ready)
    supervisor.send_signal(signal.SIGTERM)
    supervisor.wait(timeout=30)  # not communicate(): the slow process holds the pipes open until it ends
    assert done.exists(), "the supervisor ended before the process it ran"
    assert "slow stopped" in supervisor.communicate(timeout=30)[1]


def _wait_for_text(stream_path: Path, text: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = stream_path.read_text() if stream_path.exists() else ""
        if text in content:
            return content
        time.sleep(0.05)
    raise AssertionError(f"never saw {text!r} in {stream_path}: {content[-2000:]}")


def test_a_process_that_dies_once_the_service_is_up_is_restarted_its_group_stopped_first(tmp_path: Path) -> None:
    """As compose's `restart: unless-stopped`: killing one role (the GPU worker, gunicorn's master) must not
    take the service down; what it left in its group (a master's workers) goes before it starts again."""
    starts, child_pids = tmp_path / "starts", tmp_path / "children"
    (tmp_path / "Procfile").write_text(
        f"worker: echo started >> {starts}; sleep 60 & echo $! >> {child_pids}; wait\nsteady: exec sleep 60\n"
    )
    err_path = tmp_path / "err"
    with open(err_path, "w") as err:
        supervisor = subprocess.Popen(
            # A start-up window of 0: every death is past it from the start, so no wait for it to end (a death
            # inside one stops everything: test_before_the_service_is_ready_an_early_death_still_stops_everything).
            [sys.executable, "-m", "tools.procfile", str(tmp_path / "Procfile"), "--startup-s", "0"],
            cwd=tmp_path,
            stderr=err,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            start_new_session=True,
        )
        try:
            _wait_for(starts)
            shell = int(_wait_for_text(err_path, "worker started (pid").split("worker started (pid ")[1].split(")")[0])
            first_child = int(child_pids.read_text().split()[0])
            os.kill(shell, signal.SIGKILL)  # the role's main process dies; its child lives on
            text = _wait_for_text(err_path, "worker restarted")
            assert "worker ended (status -9)" in text and "restarting in 1 s" in text
            assert not _alive(first_child)  # its group was stopped before the restart
            wait_until_lines = time.monotonic() + 10
            while len(starts.read_text().split()) < 2 and time.monotonic() < wait_until_lines:
                time.sleep(0.05)
            assert len(starts.read_text().split()) == 2 and supervisor.poll() is None  # the service stays up
            second = int(
                _wait_for_text(err_path, "worker restarted (pid").split("worker restarted (pid ")[1].split(")")[0]
            )
            os.kill(second, signal.SIGKILL)  # again at once: the backoff doubles
            assert "restarting in 2 s" in _wait_for_text(err_path, "restarting in 2 s")
            supervisor.send_signal(signal.SIGTERM)  # Ctrl-C still stops everything
            assert supervisor.wait(timeout=30) == 0
        finally:
            if supervisor.poll() is None:
                os.killpg(supervisor.pid, signal.SIGKILL)
    assert all(not _alive(int(pid)) for pid in child_pids.read_text().split())


def test_no_restart_keeps_honchos_rule(tmp_path: Path) -> None:
    supervisor = _start(
        tmp_path, "short: sleep 1; exit 4\nlong: exec sleep 60\n", None, "--startup-s", "0", "--no-restart"
    )
    _, err = supervisor.communicate(timeout=30)
    assert supervisor.returncode == 4 and "short ended (status 4): stopping everything" in err
    assert "restart" not in err.replace("--no-restart", "")


def test_once_the_ready_url_answers_the_ready_line_is_said_and_an_early_death_is_restarted(tmp_path: Path) -> None:
    """make run stopped everything when a process died in its first 15 s, even after /readyz said ready: once the
    service said it is ready, a process that dies is restarted whatever its age; and the "ready at" line comes."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = tmp_path / "started"
    (tmp_path / "Procfile").write_text(
        f"web: exec {sys.executable} -m http.server {port} --bind 127.0.0.1\n"
        f"worker: echo up >> {started}; exec sleep 60\n"
    )
    err_path = tmp_path / "err"
    with open(err_path, "w") as err:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tools.procfile",
                str(tmp_path / "Procfile"),
                "--startup-s",
                "120",
                "--ready-url",
                f"http://127.0.0.1:{port}/",
                "--ready-message",
                "ready at the test's URL",
            ],
            cwd=tmp_path,
            stderr=err,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            start_new_session=True,
        )
        try:
            text = _wait_for_text(err_path, "ready at the test's URL")
            worker = int(text.split("worker started (pid ")[1].split(")")[0])
            os.kill(worker, signal.SIGKILL)  # well inside --startup-s, after ready
            text = _wait_for_text(err_path, "worker restarted")
            assert "stopping everything" not in text and supervisor.poll() is None
            assert text.count("ready at the test's URL") == 1
            supervisor.send_signal(signal.SIGINT)  # Ctrl-C
            assert supervisor.wait(timeout=30) == 0
        finally:
            if supervisor.poll() is None:
                os.killpg(supervisor.pid, signal.SIGKILL)


def test_before_the_service_is_ready_an_early_death_still_stops_everything(tmp_path: Path) -> None:
    supervisor = _start(
        tmp_path,
        "short: sleep 0.3; exit 5\nlong: exec sleep 60\n",
        None,
        "--startup-s",
        "60",
        "--ready-url",
        "http://127.0.0.1:9/never",
    )
    _, err = supervisor.communicate(timeout=30)
    assert supervisor.returncode == 5 and "short ended (status 5) within 60 s of the start: stopping everything" in err


def test_a_burst_of_interrupts_still_stops_everything(tmp_path: Path) -> None:
    """The handler printed: a Ctrl-C landing while the loop was printing raised "reentrant call" inside stderr's
    writer, which ended the supervisor and left every process running (make run then stopped Redis under them).
    Signals are noted by the handler and acted on by the loop; a burst of them stops everything once."""
    child_pid = tmp_path / "child.pid"
    supervisor = _start(tmp_path, f"worker: sleep 60 & echo $! > {child_pid}; wait\nother: exec sleep 60\n")
    child = int(_wait_for(child_pid))
    for _ in range(50):
        supervisor.send_signal(signal.SIGINT)
    _, err = supervisor.communicate(timeout=30)
    assert supervisor.returncode == 0 and "Traceback" not in err
    assert err.count("SIGINT received") >= 1 and "sent SIGTERM to worker" in err
    assert not _alive(child)


def test_ctrl_c_in_a_terminal_ends_make_with_0_after_a_clean_stop(tmp_path: Path) -> None:
    """Issue 53: every Ctrl-C of `make run` ended with `make: *** [Makefile:4: run] Error 130` (make, signalled
    too, kills itself once its child ends). With --own-terminal the supervisor alone gets the terminal's SIGINT."""
    from tools.terminal_session import TerminalSession

    up = tmp_path / "up"
    (tmp_path / "Procfile").write_text(f"worker: echo up > {up}; exec sleep 60\n")
    (tmp_path / "Makefile").write_text(
        f"run:\n\t{sys.executable} -m tools.procfile {tmp_path / 'Procfile'} --own-terminal; echo make-saw $$?\n"
    )
    session = TerminalSession(
        ["make", "-s", "run"], tmp_path, {**os.environ, "PYTHONPATH": str(REPO_ROOT)}, tmp_path / "terminal.log"
    )
    try:
        _wait_for(up)
        session.type_ctrl_c()
        status = session.wait(30)
    finally:
        session.close()
    log = (tmp_path / "terminal.log").read_text()
    assert status == 0, log
    assert "SIGINT received" in log and "worker stopped" in log and "make-saw 0" in log
    assert "Error" not in log and "Interrupt" not in log, log


def test_a_child_that_left_its_process_group_is_stopped_too(tmp_path: Path) -> None:
    """A process of a role's session that made a group of its own (job control, a helper of a daemon) was out of
    the reach of the group's signal: the stop ended with it still running."""
    escaped = tmp_path / "escaped.pid"
    script = (
        f"import os, time; os.setpgid(0, 0); open({str(escaped)!r}, 'w').write(f'{{os.getpid()}}\\n'); time.sleep(60)"
    )
    supervisor = _start(tmp_path, f'worker: {sys.executable} -c "{script}" & wait\n', None, "--kill-wait-s", "2")
    pid = int(_wait_for(escaped))
    assert os.getpgid(pid) == pid  # a group of its own, in the worker's session
    supervisor.send_signal(signal.SIGTERM)
    _, err = supervisor.communicate(timeout=30)
    assert not _alive(pid), err
    assert supervisor.returncode == 0 and "worker stopped cleanly" in err, err


def test_a_stop_names_what_needed_sigkill_and_ends_even_when_sigkill_does_not_end_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process stuck in the kernel outlives SIGKILL: the stop names it and ends instead of waiting forever (here
    the kernel's answer is stood in for: every process is reported alive)."""
    from tools import procfile

    supervisor = procfile.Supervisor({"stuck": "exec sleep 60"}, dict(os.environ), kill_wait_s=0.5)
    monkeypatch.setattr(procfile, "_session_members", lambda sid: {sid})
    supervisor.received.append(signal.SIGTERM)  # handled as the loop's first act, once the process has started
    started = time.monotonic()
    status = supervisor._supervise()
    pid = supervisor.shells["stuck"].pid
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert "still running 0.5 s after SIGTERM: stuck; sending SIGKILL" in err, err
    assert f"still running 0.5 s after SIGKILL (stuck in the kernel?), left as they are: stuck (pids {pid})" in err
    assert status == 143 and supervisor.killed  # a stop that had to kill is not a clean one
    assert supervisor.shells["stuck"].wait(5) is not None  # the real one did end
