"""Child processes the launcher owns, started in their own session and stopped by PID."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class ManagedProcess:
    """One child process with its log file; stopped with SIGTERM, then SIGKILL of its group."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # the CPUs it may run on; empty: any
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    @property
    def pid(self) -> int | None:
        """PID of the child, once started."""
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        """Starts the child in a new session (its own process group)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        if self.cpus:
            # Set before the child has started any thread or process: all of them inherit it.
            os.sched_setaffinity(self.popen.pid, self.cpus)
        self.started_at = time.time()
        log.info("started %s (pid %d), log %s", self.name, self.popen.pid, self.log_path)

    def returncode(self) -> int | None:
        """Exit status, or None while running (or never started)."""
        return self.popen.poll() if self.popen else None

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the child; after `grace_s`, SIGKILL to its whole process group."""
        if self.popen is None:
            return None
        pid = self.popen.pid
        if self.popen.poll() is None:
            try:
                os.kill(pid, signal.SIGTERM)
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s (pid %d) ignored SIGTERM for %.0f s: killing", self.name, pid, grace_s
                )
            except ProcessLookupError:
                pass
        # Children of the child (e.g. vLLM workers) share its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        return self.popen.wait()
