"""Containment and limits of the bubblewrap sandbox, tried from inside it.

Each test runs untrusted-looking code through `Sandbox.run` and then checks, from the
host, that nothing leaked: no connection reached a host listener, no host file was
read or written, no host process was seen or signalled, no process outlived its run,
and the same sandbox keeps running commands afterwards.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

from services.api.v1 import common_pb2
from services.config import MIB
from services.config.envs import SandboxConfig
from services.envs.sandbox import (
    BubblewrapSandbox,
    Sandbox,
    SandboxUnavailable,
    make_sandbox,
)
from services.envs.workspace import WorkspaceError, Workspaces

Backend = Literal["bubblewrap", "pod"]
# The per-command limits every backend keeps (the pod backend has no namespaces: what
# rests on them, network, mounts, pid namespace, is bubblewrap's alone).
BACKENDS = pytest.mark.parametrize("backend", ["bubblewrap", "pod"])


@pytest.fixture
def root() -> Iterator[Path]:
    """A directory the sandbox uid can traverse (pytest's tmp_path is mode 700)."""
    path = Path(tempfile.mkdtemp(prefix="etude-ws-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _workspace(root: Path, sandbox: Sandbox) -> Path:
    workspace = root / "workspace"
    workspace.mkdir()
    sandbox.prepare(workspace)
    return workspace


def _python(sandbox: Sandbox, workspace: Path, code: str, wall_s: float = 20.0) -> str:
    outcome = sandbox.run(workspace, ["python3", "-c", code], wall_s=wall_s)
    assert outcome.exit_code == 0, outcome
    return outcome.stdout.decode()


def _assert_still_serves(sandbox: Sandbox, workspace: Path) -> None:
    outcome = sandbox.run(workspace, ["python3", "-c", "print('alive')"])
    assert (outcome.exit_code, outcome.stdout) == (0, b"alive\n"), outcome


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


def test_commands_run_unprivileged_in_the_workspace(root: Path) -> None:
    sandbox = make_sandbox(SandboxConfig())
    assert sandbox.name == "bubblewrap"
    workspace = _workspace(root, sandbox)
    out = _python(
        sandbox,
        workspace,
        "import os, socket; open('made.txt', 'w').write('hi'); "
        "print(os.getuid(), os.getcwd(), socket.gethostname())",
    )
    assert out.split() == ["65534", "/workspace", "sandbox"]
    assert (workspace / "made.txt").read_text() == "hi"


def test_no_network_not_even_the_hosts_loopback(root: Path) -> None:
    sandbox = make_sandbox(SandboxConfig())
    workspace = _workspace(root, sandbox)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        out = _python(
            sandbox,
            workspace,
            "import socket\n"
            "print(sorted(name for _, name in socket.if_nameindex()))\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as error:\n"
            "    print('refused', error.errno)\n"
            "try:\n"
            "    socket.getaddrinfo('localhost.localdomain', 80)\n"
            "    print('resolved')\n"
            "except OSError:\n"
            "    print('no-dns')\n",
        )
        with pytest.raises(TimeoutError):
            listener.accept()
    lines = out.splitlines()
    assert lines[0] == "['lo']"
    assert lines[1].startswith("refused") and lines[2] == "no-dns"
    _assert_still_serves(sandbox, workspace)


def test_files_outside_the_workspace_cannot_be_read_or_written(root: Path) -> None:
    sandbox = make_sandbox(SandboxConfig())
    workspace = _workspace(root, sandbox)
    secret = root / "secret.txt"
    secret.write_text("host secret")
    secret.chmod(0o666)  # only the mount namespace stands between the sandbox and it
    open_dir = root / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    out = _python(
        sandbox,
        workspace,
        "import os\n"
        f"os.symlink({str(secret)!r}, 'link')\n"
        "os.symlink('../secret.txt', 'relative-link')\n"
        f"reads = [{str(secret)!r}, '../secret.txt', 'link', 'relative-link', '/etc/shadow']\n"
        f"writes = ['../escape.txt', {str(open_dir / 'escape.txt')!r}, '/usr/escape.txt',\n"
        "          '/workspace/../escape.txt']\n"
        "for path in reads:\n"
        "    try:\n"
        "        print('LEAK', path, open(path).read())\n"
        "    except OSError:\n"
        "        print('blocked', path)\n"
        "for path in writes:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError:\n"
        "        print('blocked', path)\n",
    )
    assert "LEAK" not in out, out
    assert (secret.read_text(), secret.stat().st_mode & 0o777) == ("host secret", 0o666)
    assert not (root / "escape.txt").exists() and not (open_dir / "escape.txt").exists()
    assert not Path("/usr/escape.txt").exists()
    # `..` of /workspace is the sandbox's own root: a read-only tmpfs, never the host's.
    assert [line.split()[0] for line in out.splitlines()] == ["blocked"] * 9, out
    _assert_still_serves(sandbox, workspace)


def test_file_tools_refuse_paths_that_leave_the_workspace(root: Path) -> None:
    sandbox = make_sandbox(SandboxConfig())
    workspaces = Workspaces(root / "envs", sandbox)
    (root / "outside").mkdir()
    (root / "outside" / "secret.txt").write_text("host secret")
    workspace = workspaces.create(common_pb2.Task(task_id="t/1", family="test"))
    os.symlink(root / "outside" / "secret.txt", workspace.path / "link")
    os.symlink(root / "outside", workspace.path / "dirlink")
    ws = workspace.workspace_id
    for bad in ("link", "../../outside/secret.txt", "/etc/passwd", "dirlink/secret.txt"):
        with pytest.raises(WorkspaceError):
            workspaces.read_file(ws, bad, 1000)
    for bad in ("../escape.txt", "dirlink/new.txt", "/tmp/escape.txt"):
        with pytest.raises(WorkspaceError):
            workspaces.write_file(ws, bad, "x")
    with pytest.raises(WorkspaceError):
        workspaces.list_dir(ws, "..")
    assert sorted(os.listdir(root / "outside")) == ["secret.txt"]
    assert workspaces.write_file(ws, "inside/ok.txt", "fine") == 4
    assert workspaces.read_file(ws, "inside/ok.txt", 100) == "fine"


def test_host_processes_are_invisible_and_cannot_be_signalled(root: Path) -> None:
    sandbox = make_sandbox(SandboxConfig())
    workspace = _workspace(root, sandbox)
    host = subprocess.Popen(["sleep", "60"])
    try:
        out = _python(
            sandbox,
            workspace,
            "import os, signal\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "print(pids)\n"
            "for pid in (" + str(host.pid) + ", " + str(os.getpid()) + "):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print('signalled')\n"
            "    except ProcessLookupError:\n"
            "        print('no such process')\n",
        )
        pids = [int(pid) for pid in out.splitlines()[0].strip("[]").split(",")]
        assert len(pids) <= 2 and host.pid not in pids  # itself (and bwrap's init, if any)
        assert out.splitlines()[1:] == ["no such process", "no such process"]
        assert host.poll() is None
    finally:
        host.kill()
        host.wait()
    _assert_still_serves(sandbox, workspace)


@BACKENDS
def test_memory_is_capped(root: Path, backend: Backend) -> None:
    sandbox = make_sandbox(SandboxConfig(memory_bytes=256 * MIB, backend=backend))
    workspace = _workspace(root, sandbox)
    outcome = sandbox.run(
        workspace, ["python3", "-c", "block = bytearray(1024 * 1024 * 1024)\nprint('allocated')"]
    )
    assert outcome.exit_code != 0 and b"MemoryError" in outcome.stderr
    assert b"allocated" not in outcome.stdout
    _assert_still_serves(sandbox, workspace)


@BACKENDS
def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing(
    root: Path, backend: Backend
) -> None:
    sandbox = make_sandbox(SandboxConfig(max_processes=16, backend=backend))
    workspace = _workspace(root, sandbox)
    marker = f"etude-bomb-{secrets.token_hex(4)}"
    outcome = sandbox.run(
        workspace,
        [
            "python3",
            "-c",
            "import os\n"
            "count = 0\n"
            "try:\n"
            "    while count < 1000:\n"
            "        if os.fork() == 0:\n"
            "            os.execv('/usr/bin/sleep', ['sleep', '60', '" + marker + "'])\n"
            "        count += 1\n"
            "except OSError as error:\n"
            "    print(count, error.errno)\n",
        ],
        wall_s=20,
    )
    forks, errno = (int(x) for x in outcome.stdout.split())
    assert forks < 16 and errno == 11  # EAGAIN from RLIMIT_NPROC
    assert _host_processes_with(marker) == []
    _assert_still_serves(sandbox, workspace)


# A uid no other test's sandbox runs as (their default is 65534).
OWN_UID = 64_999


@BACKENDS
def test_many_runs_in_a_row_leave_no_process_behind(root: Path, backend: Backend) -> None:
    """Under a small process limit, a leftover (even a zombie) per run would soon fail.
    RLIMIT_NPROC counts every process of the uid on the host, and the other test worker's
    sandboxes run as the default uid (in CI one of its runs left `true` unable to start:
    EAGAIN), so this one runs as a uid of its own."""
    sandbox = make_sandbox(SandboxConfig(max_processes=6, backend=backend, uid=OWN_UID))
    workspace = _workspace(root, sandbox)
    for _ in range(30):
        assert sandbox.run(workspace, ["true"]).exit_code == 0
    for _ in range(6):
        assert sandbox.run(workspace, ["sleep", "5"], wall_s=0.2).timed_out
    _assert_still_serves(sandbox, workspace)


def test_disk_writes_are_capped(root: Path) -> None:
    sandbox = make_sandbox(SandboxConfig(max_file_bytes=MIB, tmp_bytes=4 * MIB))
    workspace = _workspace(root, sandbox)
    outcome = sandbox.run(
        workspace,
        [
            "python3",
            "-c",
            "import os\n"
            "paths = ['big.bin', '/root.bin', '/dev/root.bin']\n"
            "paths += [f'{d}/{n}.bin' for d in ('/tmp', '/dev/shm') for n in range(5)]\n"
            "for path in paths:\n"
            "    try:\n"
            "        with open(path, 'wb') as f:\n"
            "            f.write(b'x' * (1024 * 1024 - 4096))\n"
            "            f.write(b'y' * (8192 if path == 'big.bin' else 4096))\n"
            "        print('wrote', path)\n"
            "    except OSError as error:\n"
            "        print('refused', path, error.errno)\n",
        ],
    )
    lines = outcome.stdout.decode().splitlines()
    assert lines[0] == "refused big.bin 27"  # EFBIG: RLIMIT_FSIZE
    assert (workspace / "big.bin").stat().st_size <= MIB
    assert lines[1:3] == ["refused /root.bin 30", "refused /dev/root.bin 30"]  # EROFS
    # /tmp and /dev/shm are 4 MiB tmpfs each: the fourth or fifth 1 MiB file does not fit.
    for directory in ("/tmp/", "/dev/shm/"):
        refused = [line for line in lines if line.startswith(f"refused {directory}")]
        assert refused and all(line.endswith(" 28") for line in refused), lines  # ENOSPC
    _assert_still_serves(sandbox, workspace)


@BACKENDS
def test_cpu_time_is_capped(root: Path, backend: Backend) -> None:
    sandbox = make_sandbox(SandboxConfig(cpu_s=1, backend=backend))
    workspace = _workspace(root, sandbox)
    outcome = sandbox.run(workspace, ["python3", "-c", "while True: pass"], wall_s=30)
    assert not outcome.timed_out and outcome.killed_by == "rlimit_cpu"
    _assert_still_serves(sandbox, workspace)


@BACKENDS
def test_wall_clock_kills_the_whole_tree_including_daemons(root: Path, backend: Backend) -> None:
    sandbox = make_sandbox(SandboxConfig(backend=backend))
    workspace = _workspace(root, sandbox)
    marker = f"etude-daemon-{secrets.token_hex(4)}"
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv('/usr/bin/sleep', ['sleep', '120', '" + marker + "'])\n"
        "    os._exit(0)\n"
    )
    outcome = sandbox.run(workspace, ["python3", "-c", daemon + "time.sleep(60)\n"], wall_s=1.0)
    assert outcome.timed_out and outcome.killed_by == "wall_clock"
    assert _host_processes_with(marker) == []
    # A daemon left by a command that exits normally goes with it too.
    outcome = sandbox.run(workspace, ["python3", "-c", daemon + "time.sleep(0.2)\n"])
    assert not outcome.timed_out and outcome.exit_code == 0
    assert _host_processes_with(marker) == []
    _assert_still_serves(sandbox, workspace)


@BACKENDS
def test_output_is_cut_at_the_limit_while_read(root: Path, backend: Backend) -> None:
    sandbox = make_sandbox(SandboxConfig(max_output_bytes=4096, backend=backend))
    workspace = _workspace(root, sandbox)
    outcome = sandbox.run(
        workspace,
        [
            "python3",
            "-c",
            "import sys\n"
            "for _ in range(2000):\n"
            "    sys.stdout.write('o' * 4096)\n"
            "    sys.stderr.write('e' * 4096)\n",
        ],
    )
    assert outcome.exit_code == 0
    assert outcome.stdout == b"o" * 4096 and outcome.stdout_truncated
    assert outcome.stderr == b"e" * 4096 and outcome.stderr_truncated
    _assert_still_serves(sandbox, workspace)


def test_without_bubblewrap_untrusted_code_is_refused_unless_unsafe_is_set(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty_bin = root / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))  # no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="allow_unsafe_local"):
        make_sandbox(SandboxConfig())
    unsafe = make_sandbox(SandboxConfig(allow_unsafe_local=True))
    assert unsafe.name == "unsafe-local"
    workspace = _workspace(root, unsafe)
    outcome = unsafe.run(workspace, ["/usr/bin/python3", "-c", "import os; print(os.getuid())"])
    assert outcome.exit_code == 0 and outcome.stdout == b"65534\n"  # rlimits and uid still apply
    with pytest.raises(ValueError, match="argv"):
        unsafe.run(workspace, [])


def test_the_pod_backend_drops_the_uid_and_the_services_environment(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gVisor or Kata pods: no namespaces, but the command runs as the sandbox uid, in its
    workspace, with nothing of the service's environment (its token) and no way to read
    it through /proc; a service that cannot drop its uid refuses the backend."""
    monkeypatch.setenv("ETUDE_AUTH__TOKEN", "secret-token")
    sandbox = make_sandbox(SandboxConfig(backend="pod"))
    assert sandbox.name == "pod"
    workspace = _workspace(root, sandbox)
    out = _python(
        sandbox,
        workspace,
        "import os\n"
        "print(os.getuid(), os.getcwd())\n"
        "print('ETUDE_AUTH__TOKEN' in os.environ)\n"
        f"try:\n    open('/proc/{os.getpid()}/environ', 'rb').read(); print('read')\n"
        "except OSError as error:\n    print('refused', error.errno)\n",
    )
    assert out.splitlines() == [f"65534 {workspace}", "False", "refused 13"], out
    monkeypatch.setattr(os, "geteuid", lambda: 10001)
    with pytest.raises(SandboxUnavailable, match="runAsUser: 0"):
        make_sandbox(SandboxConfig(backend="pod"))


def test_a_sandbox_that_cannot_start_says_how_to_fix_it(root: Path) -> None:
    """What envs readiness reports: bubblewrap without user namespaces (as under default
    pod security) names the gVisor/Kata runtimeClassName and the securityContext; the
    real sandbox here passes the same check."""
    assert make_sandbox(SandboxConfig()).self_test(root) is None
    assert make_sandbox(SandboxConfig(backend="pod")).self_test(root) is None
    denied = root / "bwrap"
    denied.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create a new namespace, likely because "
        "the kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    denied.chmod(0o755)
    problem = BubblewrapSandbox(SandboxConfig(), str(denied)).self_test(root)
    assert problem is not None and "No permissions to create a new namespace" in problem
    assert "envs.runtimeClassName" in problem and "securityContext" in problem
    assert [p.name for p in root.iterdir()] == ["bwrap"]  # its scratch workspace is gone
