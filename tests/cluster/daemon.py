"""A long-running process of the test node (containerd, kubelet, kube-proxy).

Each writes a pid file holding its pid and start time (``/proc/<pid>/stat``'s 22nd
field), so a later run that finds the file (its predecessor was killed before it
could stop anything) ends exactly that process and no other that got the pid since.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: split after its closing paren.
    return stat.rsplit(")", 1)[1].split()[19]


def record(pidfile: Path, pid: int) -> None:
    """Write ``pid`` (and its start time) where ``kill_recorded`` finds it."""
    pidfile.write_text(f"{pid} {_start_time(pid)}\n")


def kill_recorded(pidfile: Path, timeout_s: float = 10) -> None:
    """Stop the process a pid file names if it still runs (TERM, then KILL), and drop the file."""
    try:
        pid_s, started = pidfile.read_text().split()
        pid = int(pid_s)
    except (OSError, ValueError):
        pidfile.unlink(missing_ok=True)
        return
    if _start_time(pid) == started:
        _terminate(pid, timeout_s)
    pidfile.unlink(missing_ok=True)


def _terminate(pid: int, timeout_s: float) -> None:
    started = _start_time(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _start_time(pid) != started or _zombie(pid):
            return  # gone (a zombie is waited for by its parent, not us)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass
class Daemon:
    name: str
    argv: list[str]
    log: Path
    pidfile: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Daemon:
        with self.log.open("ab") as log:
            # Own session: a signal to the test's process group does not reach it
            # before the harness has had its say on the order of stopping.
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )
        record(self.pidfile, self.proc.pid)
        return self

    def exited(self) -> int | None:
        """The exit status once it has exited; None while it runs (or never started)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.pidfile.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would end it: nothing of its own shutdown runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
