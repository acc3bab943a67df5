"""Running untrusted commands: bubblewrap sandboxes with resource limits.

A command runs in a fresh set of namespaces (``--unshare-all``: no network, its own
PIDs, IPC, hostname, user namespace), sees the toolchain (``/usr``) read-only and only
its workspace writable, gets a private ``/tmp`` and ``/dev/shm`` (size-limited tmpfs;
everything else is read-only), dies with its parent, and runs as an unprivileged uid
so every rlimit applies (RLIMIT_NPROC is not enforced for root). Limits: CPU seconds,
address space, processes, file size, open files; a wall-clock timeout kills the whole
process group; stdout and stderr are cut at a size limit while the process is still
read (a flood cannot fill the worker's memory).

Each outcome also carries what ``services.envs.faults`` needs to tell the code's failures
from the infrastructure's: whether the sandbox started at all, the CPU seconds the
command's process tree used, how long its threads ran and waited on the run queue in the
last quarter of a run that timed out, and whether a signal from outside the sandbox
ended it. The last is exact under bubblewrap: the command is pid 1 of its PID
namespace, which nothing inside the namespace can kill with SIGKILL (or with any signal
it has no handler for), and its real wait status comes from a pidfd
(``PIDFD_INFO_EXIT``), so ``exit(137)`` is not mistaken for a kill.

Without bubblewrap, untrusted code is refused unless ``allow_unsafe_local`` is set
(then commands run as plain subprocesses with the same rlimits: for trusted tests only).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.config.envs import SandboxConfig

SANDBOX_HOME = "/workspace"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# A run given its own CPU limit (a timeout judged by CPU time) gets this many times that
# limit as its wall clock: an innocent program must get a third of a CPU to be judged.
JUDGE_WALL_FACTOR = 3
# The final share of a run's wall clock in which its threads' scheduling is sampled.
TAIL_SHARE = 0.25
# What the start-pipe wrapper runs, before its fd number, inside a set-up sandbox: it
# writes the start byte, then execs the command (which so replaces it as pid 1).
START_SIGNAL = "printf x >&"


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
    # CPU seconds (user + system) of the command and the descendants reaped in it.
    cpu_s: float = 0.0
    # When the wall clock ran out (0 otherwise): the last TAIL_SHARE of the run, and the
    # seconds the sandbox's threads ran and waited on the run queue for a CPU in it.
    # A starved program waits; a sleeping or blocked one does neither.
    tail_s: float = 0.0
    tail_run_s: float = 0.0
    tail_wait_s: float = 0.0
    # False when the sandbox never ran the command (setup failed, fork refused).
    started: bool = True
    # A signal sent from outside the sandbox (not our timeout, not the CPU limit) ended it.
    killed_outside: bool = False


_SIGNAL_NAMES: dict[int, str] = {
    signal.SIGXCPU: "rlimit_cpu",
    signal.SIGXFSZ: "rlimit_fsize",
    signal.SIGKILL: "SIGKILL",
    signal.SIGSEGV: "SIGSEGV",
}


# Signals that end a PID namespace's init only when sent from outside the namespace (it
# has no handler for them, so the kernel drops them when sent from inside).
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
# ioctl(PIDFD_GET_INFO) with struct pidfd_info (version 0, 64 bytes): the exit status of a
# process that is not our child, kept by the kernel for as long as we hold its pidfd.
_PIDFD_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 1 << 3


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


def _exit_status(pidfd: int) -> int | None:
    """The wait status of the (reaped) process behind `pidfd`, or None if unknown."""
    info = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("Q", info, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
    except OSError:  # an older kernel, or the process is not reaped yet
        return None
    (mask,) = struct.unpack_from("Q", info, 0)
    if not mask & _PIDFD_INFO_EXIT:
        return None
    (status,) = struct.unpack_from("i", info, 60)
    return int(status)


def _read_child_pid(fd: int, timeout: float) -> int | None:
    """The command's host pid from bwrap's ``--info-fd`` JSON, or None if bwrap closed it
    without one (it could not set the sandbox up) or said nothing within `timeout`."""
    deadline = time.monotonic() + timeout
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        pid = json.loads(data).get("child-pid")
    except ValueError:
        return None
    return pid if isinstance(pid, int) else None


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc children lists)."""
    tree, index = [pid], 0
    while index < len(tree):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{tree[index]}/task"):
                with open(f"/proc/{tree[index]}/task/{task}/children") as listing:
                    tree.extend(int(child) for child in listing.read().split())
        index += 1
    return tree


def _schedstats(pid: int) -> dict[str, tuple[int, int]]:
    """{thread id: (ns on a CPU, ns runnable waiting for one)} of `pid`'s live process
    tree (/proc/<pid>/task/<tid>/schedstat)."""
    stats: dict[str, tuple[int, int]] = {}
    for process in _tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for task in os.listdir(f"/proc/{process}/task"):
                with open(f"/proc/{process}/task/{task}/schedstat") as line:
                    ran, waited = line.read().split()[:2]
                stats[task] = (int(ran), int(waited))
    return stats


def _ran_and_waited_s(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> tuple[float, float]:
    """Seconds run and waited for a CPU between two samples, over the threads of `after`."""
    ran = waited = 0
    for task, (ran_after, waited_after) in after.items():
        ran_before, waited_before = before.get(task, (0, 0))
        ran += ran_after - ran_before
        waited += waited_after - waited_before
    return ran / 1e9, waited / 1e9


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
    # Whether the sandbox reports the command's host pid and that it set itself up
    # (bubblewrap): then a failed setup and a kill from outside can be told apart.
    reports_child_pid = False
    # What to do when it cannot run a command (the readiness message ends with it).
    fix = "see docs/envs.md (Sandboxes in pods)"

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def command(
        self,
        workspace: Path,
        argv: Sequence[str],
        env: Mapping[str, str],
        info_fd: int | None = None,
        started_fd: int | None = None,
        go_fd: int | None = None,
    ) -> list[str]:
        """The argv that runs `argv` inside this sandbox, writing the command's host pid
        (JSON) to `info_fd` and one byte to `started_fd` once the sandbox is set up, then
        waiting for a byte (or the end) on `go_fd` before the command runs."""

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

    def self_test(self, scratch: Path) -> str | None:
        """Runs a command the way rollouts do, in a fresh workspace under `scratch`; None
        when it ran, else what failed and how to fix it (the readiness message)."""
        workspace = Path(tempfile.mkdtemp(prefix="self-test-", dir=scratch))
        try:
            self.prepare(workspace)
            outcome = self.run(workspace, ["sh", "-c", "echo ok > probe && cat probe"], wall_s=30)
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
        if outcome.exit_code == 0 and outcome.stdout.strip() == b"ok":
            return None
        detail = (outcome.stderr or outcome.stdout).decode(errors="replace").strip()[-300:]
        code = outcome.exit_code
        return f"the {self.name} sandbox cannot run a command (exit {code}: {detail}); {self.fix}"

    def run(
        self,
        workspace: Path,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        env: Mapping[str, str] | None = None,
        wall_s: float | None = None,
        cpu_s: int | None = None,
    ) -> ExecOutcome:
        """Runs `argv`; never raises for what the command does, only for bad arguments.

        `cpu_s` replaces the configured CPU limit; a run given one gets JUDGE_WALL_FACTOR
        times it as its wall clock unless `wall_s` says otherwise (at most that many times
        the configured one): a run judged by its CPU time needs room to be slow on a loaded
        host.
        """
        if not argv or not argv[0]:
            raise ValueError("argv must name a program")
        config = self.config
        if cpu_s is not None:
            config = config.model_copy(update={"cpu_s": cpu_s})
        if cpu_s is None:
            wall = min(wall_s or config.wall_s, config.wall_s)
        else:
            wall = min(wall_s or JUDGE_WALL_FACTOR * cpu_s, JUDGE_WALL_FACTOR * self.config.wall_s)
        full_env = {"PATH": DEFAULT_PATH, "HOME": SANDBOX_HOME, "LANG": "C.UTF-8", **(env or {})}
        started = time.perf_counter()
        uid = self.run_uid()
        # Read ends, write ends: the command's host pid, and a byte its sandbox writes
        # once set up (the command itself never holds that fd); and the go pipe, whose
        # read end the sandbox waits on and whose write end stays here.
        pipes = [os.pipe(), os.pipe()] if self.reports_child_pid else []
        reads, writes = tuple(r for r, _ in pipes), tuple(w for _, w in pipes)
        go_read, go_write = os.pipe() if pipes else (None, None)
        passed = (*writes, go_read) if go_read is not None else ()
        try:
            process = subprocess.Popen(
                _limited(
                    config,
                    uid,
                    self.command(workspace, argv, full_env, *(passed or (None, None, None))),
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workspace,
                env=full_env,
                start_new_session=True,
                pass_fds=passed,
            )
        except OSError as error:
            for fd in (*reads, go_write):
                if fd is not None:
                    os.close(fd)
            if error.errno not in (errno.EAGAIN, errno.ENOMEM):
                raise
            # The host could not fork: nothing the command did.
            return ExecOutcome(
                exit_code=-1,
                stdout=b"",
                stderr=str(error).encode(),
                timed_out=False,
                killed_by="",
                stdout_truncated=False,
                stderr_truncated=False,
                wall_s=time.perf_counter() - started,
                started=False,
            )
        finally:
            for fd in (*writes, go_read):
                if fd is not None:
                    os.close(fd)
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
        command_pidfd = None
        if reads:
            # Kept open until the end: bwrap dies of SIGPIPE if it writes to a closed pipe.
            child_pid = _read_child_pid(reads[0], wall)
            if child_pid is not None:
                with contextlib.suppress(ProcessLookupError):  # killed from outside
                    command_pidfd = os.pidfd_open(child_pid)
        if go_write is not None:
            with contextlib.suppress(BrokenPipeError):  # the sandbox never set itself up
                os.write(go_write, b"g")
            os.close(go_write)
        try:
            assert process.stdin is not None
            process.stdin.write(stdin)
            process.stdin.close()
        except BrokenPipeError:
            pass
        # The last TAIL_SHARE of the wall clock is watched: what the sandbox's threads did
        # in it tells a starved command from a sleeping one (services.envs.faults).
        tail_at = started + wall * (1 - TAIL_SHARE)
        usage = _reap(process, max(tail_at - time.perf_counter(), 0.0))
        tail_s = tail_run_s = tail_wait_s = 0.0
        if usage is None:
            tail_started, before = time.perf_counter(), _schedstats(process.pid)
            usage = _reap(process, max(started + wall - time.perf_counter(), 0.0))
            if usage is None:
                tail_run_s, tail_wait_s = _ran_and_waited_s(before, _schedstats(process.pid))
                tail_s = time.perf_counter() - tail_started
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
        sandbox_started = True
        if reads:
            os.set_blocking(reads[1], False)  # every writer has exited, but never wait
            try:
                sandbox_started = os.read(reads[1], 1) == b"x"
            except BlockingIOError:
                sandbox_started = False
            for fd in reads:
                os.close(fd)
        command_status = None
        if command_pidfd is not None:
            command_status = _exit_status(command_pidfd)
            os.close(command_pidfd)
        cpu_used = usage.ru_utime + usage.ru_stime if usage else 0.0
        killed_by = "wall_clock" if timed_out else self.signal_of(code)
        if not timed_out and code >= 0 and command_status is not None:
            # The command's own wait status, not bwrap's 128 + N (which exit(137) forges).
            killed_by = (
                self.signal_of(-os.WTERMSIG(command_status))
                if os.WIFSIGNALED(command_status)
                else ""
            )
        if killed_by == "SIGKILL" and cpu_used >= config.cpu_s:
            killed_by = "rlimit_cpu"  # the hard CPU limit kills; pid 1 ignores SIGXCPU
        killed_outside = False
        if self.reports_child_pid and not timed_out and killed_by != "rlimit_cpu":
            # bwrap is our child and we signal it only after reaping it; its command can
            # die of these signals only when they come from outside its PID namespace.
            killed_outside = code < 0 or (
                command_status is not None
                and os.WIFSIGNALED(command_status)
                and os.WTERMSIG(command_status) in _OUTSIDE_SIGNALS
            )
        return ExecOutcome(
            exit_code=code,
            stdout=b"".join(outputs["out"][0]),
            stderr=b"".join(outputs["err"][0]),
            timed_out=timed_out,
            killed_by=killed_by,
            stdout_truncated=outputs["out"][1][0],
            stderr_truncated=outputs["err"][1][0],
            wall_s=time.perf_counter() - started,
            cpu_s=cpu_used,
            tail_s=tail_s,
            tail_run_s=tail_run_s,
            tail_wait_s=tail_wait_s,
            started=sandbox_started,
            killed_outside=killed_outside,
        )


class BubblewrapSandbox(Sandbox):
    """bubblewrap: no network, the workspace as the only writable place."""

    name = "bubblewrap"
    fix = (
        "bubblewrap needs user namespaces, which default pod security forbids: run envs "
        "under gVisor or Kata (envs.runtimeClassName, with config.envs.sandbox.backend = "
        "'pod'), or allow bubblewrap's namespaces (envs.securityContext and "
        "envs.podSecurityContext, docs/deploy.md, Sandboxes)"
    )

    def __init__(self, config: SandboxConfig, binary: str) -> None:
        super().__init__(config)
        self.binary = binary
        # bash (not dash) writes to the start pipe: its fd number may be above 9.
        self._bash = shutil.which("bash", path="/usr/bin:/bin")
        self.reports_child_pid = self._bash is not None

    def signal_of(self, code: int) -> str:
        # bwrap exits with 128 + N when the command inside dies of signal N.
        if 128 < code < 128 + 65:
            return _SIGNAL_NAMES.get(code - 128, signal.Signals(code - 128).name)
        return super().signal_of(code)

    def command(
        self,
        workspace: Path,
        argv: Sequence[str],
        env: Mapping[str, str],
        info_fd: int | None = None,
        started_fd: int | None = None,
        go_fd: int | None = None,
    ) -> list[str]:
        if started_fd is not None and self._bash is not None:
            # Inside the sandbox, once bwrap has set it up: say so on a pipe, close it, and
            # become the command (still pid 1). The command never runs if setup failed, so
            # it cannot make a started sandbox look like one that failed to start.
            script = f"{START_SIGNAL}{started_fd}; exec {started_fd}>&-; "
            if go_fd is not None:
                # Held until the caller has the command's pidfd: then even a command that
                # exits at once leaves its own wait status, not only bwrap's 128 + N.
                script += f"read -r -n 1 _ <&{go_fd}; exec {go_fd}<&-; "
            argv = [self._bash, "-c", script + 'exec "$@"', "sh", *argv]
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
            # The command's pid, once the sandbox is set up (bwrap closes it before the
            # command runs: the command cannot write to it).
            *(["--info-fd", str(info_fd)] if info_fd is not None else []),
            *[arg for key, value in env.items() for arg in ("--setenv", key, value)],
            "--",
            *argv,
        ]


# The pod backend's init for one command. Without a pid namespace, a daemon the command
# leaves (setsid + fork) would outlive it, and a process the pod's pid 1 never reaps counts
# against the uid's process limit for good. So a subreaper runs the command, reaps every
# orphan handed to it, kills what remains once the command exits, and exits as it did.
_POD_REAPER = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    except OSError as error:
        sys.stderr.write(f"{sys.argv[1]}: {error.strerror}\\n")
        os._exit(127 if error.errno == 2 else 126)
status = 0
while True:
    try:
        child, code = os.wait()
    except ChildProcessError:
        break
    if child == pid:
        status = code
    if child == pid or pid is None:
        pid = None
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
sys.exit(os.waitstatus_to_exitcode(status))
"""


class PodSandbox(Sandbox):
    """The pod is the isolation boundary (gVisor, Kata): each command runs as the sandbox
    uid under the rlimits, its time and output caps and a cleared environment, with the
    workspace as its working directory, and no namespaces of its own."""

    name = "pod"

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        if os.geteuid() != 0:
            # As the service's own uid, a command could read the service's environment
            # (its token) through /proc; only root can drop it to another uid.
            raise SandboxUnavailable(
                "envs.sandbox.backend = 'pod' runs each command as envs.sandbox.uid, which "
                f"needs the envs container to run as root inside the pod (it runs as uid "
                f"{os.geteuid()}): set envs.podSecurityContext.runAsUser: 0 and "
                "runAsNonRoot: false with the gVisor or Kata runtimeClassName"
            )
        _tool("setpriv"), _tool("prlimit")  # refused now, not at the first command

    def command(
        self,
        workspace: Path,
        argv: Sequence[str],
        env: Mapping[str, str],
        info_fd: int | None = None,
        started_fd: int | None = None,
        go_fd: int | None = None,
    ) -> list[str]:
        # run() drops the uid and sets the rlimits, env and working dir; the reaper stays
        # the command's parent and takes every process it leaves behind with it.
        return [sys.executable, "-I", "-S", "-c", _POD_REAPER, *argv]


class UnsafeLocalSandbox(Sandbox):
    """No isolation beyond rlimits: only for trusted commands on machines without bwrap."""

    name = "unsafe-local"

    def command(
        self,
        workspace: Path,
        argv: Sequence[str],
        env: Mapping[str, str],
        info_fd: int | None = None,
        started_fd: int | None = None,
        go_fd: int | None = None,
    ) -> list[str]:
        return list(argv)


def make_sandbox(config: SandboxConfig) -> Sandbox:
    """The backend the config names: bubblewrap (the unsafe local runner instead only
    when explicitly allowed and bwrap is missing), or the pod as the boundary."""
    if config.backend == "pod":
        return PodSandbox(config)
    binary = shutil.which("bwrap")
    if binary is not None:
        return BubblewrapSandbox(config, binary)
    if config.allow_unsafe_local:
        return UnsafeLocalSandbox(config)
    raise SandboxUnavailable(
        "bubblewrap (bwrap) is not installed, and running untrusted code without it needs "
        "envs.sandbox.allow_unsafe_local = true (install it: apt-get install bubblewrap)"
    )
