"""Running untrusted commands: bubblewrap sandboxes with resource limits.

A command runs in a fresh set of namespaces (``--unshare-all``: no network, its own
PIDs, IPC, hostname, user namespace), sees the toolchain (``/usr``) read-only and only
its workspace writable, gets a private ``/tmp`` and ``/dev/shm`` (size-limited tmpfs;
everything else is read-only), dies with its parent, and runs as an unprivileged uid
so every rlimit applies (RLIMIT_NPROC is not enforced for root). Limits: CPU seconds,
address space, processes, file size, open files; a wall-clock timeout kills the whole
process group; stdout and stderr are cut at a size limit while the process is still
read (a flood cannot fill the worker's memory).

Without bubblewrap, untrusted code is refused unless ``allow_unsafe_local`` is set
(then commands run as plain subprocesses with the same rlimits: for trusted tests only).
"""

from __future__ import annotations

import abc
import contextlib
import os
import resource
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from services.config import MIB, StrictModel

SANDBOX_HOME = "/workspace"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxConfig(StrictModel):
    """Limits and mounts of one command in the sandbox."""

    cpu_s: int = Field(30, ge=1, le=3600, description="CPU seconds (RLIMIT_CPU).")
    wall_s: float = Field(60.0, gt=0, le=3600, description="Wall clock before the group is killed.")
    memory_bytes: int = Field(1024 * MIB, ge=16 * MIB, description="Address space (RLIMIT_AS).")
    max_processes: int = Field(
        64, ge=1, le=4096, description="Processes of the uid (RLIMIT_NPROC)."
    )
    max_file_bytes: int = Field(
        16 * MIB, ge=1024, description="Largest file written (RLIMIT_FSIZE)."
    )
    max_open_files: int = Field(256, ge=16, le=65536, description="Open files (RLIMIT_NOFILE).")
    max_output_bytes: int = Field(64 * 1024, ge=1024, description="stdout and stderr are cut here.")
    tmp_bytes: int = Field(64 * MIB, ge=MIB, description="Size of the private /tmp (tmpfs).")
    uid: int = Field(
        65534, ge=1, description="Unprivileged uid commands run as when the service is root."
    )
    allow_unsafe_local: bool = Field(
        False, description="Without bubblewrap, run commands unsandboxed (trusted tests only)."
    )


@dataclass
class ExecOutcome:
    """What a command did."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    killed_by: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float


_SIGNAL_NAMES: dict[int, str] = {
    signal.SIGXCPU: "rlimit_cpu",
    signal.SIGXFSZ: "rlimit_fsize",
    signal.SIGKILL: "SIGKILL",
    signal.SIGSEGV: "SIGSEGV",
}


class SandboxUnavailable(RuntimeError):
    """No sandbox can run untrusted code here."""


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin")
    if found is None:
        raise SandboxUnavailable(f"{name} (util-linux) is not installed: the sandbox needs it")
    return found


def _limited(config: SandboxConfig, uid: int | None, command: list[str]) -> list[str]:
    """`command` under the sandbox's rlimits (prlimit) and, as root, as `uid` (setpriv).

    Both are set by small programs that exec the next, never in the child between fork
    and exec: Python code there (``preexec_fn``) is unsafe in a threaded process, and
    ``Popen(user=..., group=...)`` makes CPython fork instead of vfork, which runs every
    native library's fork handlers in the child of a threaded process; that crashed
    sandbox children (SIGSEGV before exec) while gRPC and torch threads were running.
    """
    limits = [
        f"--cpu={config.cpu_s}:{config.cpu_s + 1}",
        f"--as={config.memory_bytes}",
        f"--fsize={config.max_file_bytes}",
        f"--nofile={config.max_open_files}",
        "--core=0",
    ]
    drop: list[str] = []
    if uid is not None:  # RLIMIT_NPROC counts the uid's processes, and root is exempt
        limits.append(f"--nproc={config.max_processes}")
        drop = [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return [_tool("prlimit"), *limits, "--", *drop, *command]


def _read_capped(stream: object, limit: int, sink: list[bytes], truncated: list[bool]) -> None:
    """Reads a pipe to its end, keeping at most `limit` bytes and draining the rest."""
    kept = 0
    read = stream.read  # type: ignore[attr-defined]
    while chunk := read(65536):
        room = limit - kept
        if room > 0:
            sink.append(chunk[:room])
            kept += min(len(chunk), room)
        if len(chunk) > room:
            truncated[0] = True
    stream.close()  # type: ignore[attr-defined]


def _reap(process: subprocess.Popen[bytes], timeout: float) -> resource.struct_rusage | None:
    """Waits up to `timeout` for `process` and reaps it: its CPU use (with the descendants
    it reaped), or None if it is still running."""
    pidfd = os.pidfd_open(process.pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not ready:
        return None
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return usage


def _kill_children(pid: int) -> None:
    """SIGKILL to the direct children of `pid` (Linux /proc children lists)."""
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                for child in listing.read().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(child), signal.SIGKILL)


class Sandbox(abc.ABC):
    """Runs a command with `workspace` as its writable working directory."""

    name: str

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def command(self, workspace: Path, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """The argv that runs `argv` inside this sandbox."""

    def run_uid(self) -> int | None:
        """The uid commands drop to (None: keep the caller's)."""
        return self.config.uid if os.geteuid() == 0 else None

    def prepare(self, workspace: Path) -> None:
        """Makes `workspace` writable by the sandbox uid."""
        uid = self.run_uid()
        if uid is None:
            return
        for root, dirs, files in os.walk(workspace):
            os.chown(root, uid, uid)
            for name in dirs + files:
                os.lchown(os.path.join(root, name), uid, uid)

    def signal_of(self, code: int) -> str:
        """The signal that ended a command with exit status `code` ("" if none)."""
        if code >= 0:
            return ""
        return _SIGNAL_NAMES.get(-code, signal.Signals(-code).name)

    def run(
        self,
        workspace: Path,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        env: Mapping[str, str] | None = None,
        wall_s: float | None = None,
    ) -> ExecOutcome:
        """Runs `argv`; never raises for what the command does, only for bad arguments."""
        if not argv or not argv[0]:
            raise ValueError("argv must name a program")
        config = self.config
        wall = min(wall_s or config.wall_s, config.wall_s)
        full_env = {"PATH": DEFAULT_PATH, "HOME": SANDBOX_HOME, "LANG": "C.UTF-8", **(env or {})}
        started = time.perf_counter()
        uid = self.run_uid()
        process = subprocess.Popen(
            _limited(config, uid, self.command(workspace, argv, full_env)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workspace,
            env=full_env,
            start_new_session=True,
        )
        outputs: dict[str, tuple[list[bytes], list[bool]]] = {
            "out": ([], [False]),
            "err": ([], [False]),
        }
        readers = [
            threading.Thread(
                target=_read_capped,
                args=(pipe, config.max_output_bytes, *outputs[key]),
                daemon=True,
            )
            for key, pipe in (("out", process.stdout), ("err", process.stderr))
        ]
        for reader in readers:
            reader.start()
        try:
            assert process.stdin is not None
            process.stdin.write(stdin)
            process.stdin.close()
        except BrokenPipeError:
            pass
        usage = _reap(process, wall)
        timed_out = usage is None
        if timed_out:
            # The command first: its sandbox parent then reaps it and exits, so no
            # orphan is left for init to reap (an unreaped zombie still counts
            # against the uid's RLIMIT_NPROC).
            _kill_children(process.pid)
            usage = _reap(process, 5.0)
        # The whole group goes, whether the command finished or timed out: nothing it
        # started may outlive it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        code = process.wait() if usage is None else process.returncode
        for reader in readers:
            reader.join(timeout=5)
        killed_by = "wall_clock" if timed_out else self.signal_of(code)
        if killed_by == "SIGKILL" and usage and usage.ru_utime + usage.ru_stime >= config.cpu_s:
            killed_by = "rlimit_cpu"  # the hard CPU limit kills; pid 1 ignores SIGXCPU
        return ExecOutcome(
            exit_code=code,
            stdout=b"".join(outputs["out"][0]),
            stderr=b"".join(outputs["err"][0]),
            timed_out=timed_out,
            killed_by=killed_by,
            stdout_truncated=outputs["out"][1][0],
            stderr_truncated=outputs["err"][1][0],
            wall_s=time.perf_counter() - started,
        )


class BubblewrapSandbox(Sandbox):
    """bubblewrap: no network, the workspace as the only writable place."""

    name = "bubblewrap"

    def __init__(self, config: SandboxConfig, binary: str) -> None:
        super().__init__(config)
        self.binary = binary

    def signal_of(self, code: int) -> str:
        # bwrap exits with 128 + N when the command inside dies of signal N.
        if 128 < code < 128 + 65:
            return _SIGNAL_NAMES.get(code - 128, signal.Signals(code - 128).name)
        return super().signal_of(code)

    def command(self, workspace: Path, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        mounts = ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else None
            if target:
                mounts += ["--symlink", target, f"/{link}"]
            elif os.path.isdir(f"/{link}"):
                mounts += ["--ro-bind", f"/{link}", f"/{link}"]
        return [
            self.binary,
            "--unshare-all",
            # The command is pid 1 of its namespace and bwrap's parent process reaps it;
            # with bwrap's own init in between, that init is left a zombie for the host's
            # init to reap (or, in a container whose pid 1 is this service, forever).
            "--as-pid-1",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
            *mounts,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(self.config.tmp_bytes),
            "--tmpfs",
            "/dev/shm",
            "--size",
            str(self.config.tmp_bytes),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(workspace.resolve()),
            SANDBOX_HOME,
            # bwrap builds / and /dev as tmpfs without a size limit (half the host's
            # RAM) that the command could fill: read-only once the mounts are made.
            "--remount-ro",
            "/dev",
            "--remount-ro",
            "/",
            "--chdir",
            SANDBOX_HOME,
            "--clearenv",
            *[arg for key, value in env.items() for arg in ("--setenv", key, value)],
            "--",
            *argv,
        ]


class UnsafeLocalSandbox(Sandbox):
    """No isolation beyond rlimits: only for trusted commands on machines without bwrap."""

    name = "unsafe-local"

    def command(self, workspace: Path, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return list(argv)


def make_sandbox(config: SandboxConfig) -> Sandbox:
    """bubblewrap when installed; the unsafe local runner only when explicitly allowed."""
    binary = shutil.which("bwrap")
    if binary is not None:
        return BubblewrapSandbox(config, binary)
    if config.allow_unsafe_local:
        return UnsafeLocalSandbox(config)
    raise SandboxUnavailable(
        "bubblewrap (bwrap) is not installed, and running untrusted code without it needs "
        "envs.sandbox.allow_unsafe_local = true (install it: apt-get install bubblewrap)"
    )
