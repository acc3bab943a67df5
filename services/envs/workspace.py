"""Workspaces: the directories rollouts work in, created from tasks, frozen into
snapshots and forked from them cheaply.

A snapshot is a frozen copy: files and directories owned by the service, read-only.
A fork is a new directory tree (owned by the sandbox uid, writable) whose files are
hard links to the snapshot's: forking 1,000 files takes a few milliseconds and no
data is copied. A forked file is shared read-only until it is replaced: the agent's
file tools always write by replacing (a new file renamed into place), and commands in
the sandbox can replace files too, but cannot change a shared file in place, so a
fork never changes its snapshot or its siblings.

File tools run here, outside the sandbox, so every path is resolved and must stay
inside its workspace: a symlink the agent made to /etc/shadow is refused, not read.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from services.api.v1 import common_pb2
from services.envs.sandbox import Sandbox
from services.wire.errors import NotFound


@dataclass
class Workspace:
    """A writable working directory for one rollout (or one caller)."""

    workspace_id: str
    path: Path
    task: common_pb2.Task | None


class WorkspaceError(ValueError):
    """A file operation the workspace does not allow (escapes it, or is not a file)."""


def _freeze(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                executable = mode & stat.S_IXUSR
                os.chmod(path, 0o555 if executable else 0o444)
        os.chmod(directory, 0o555)


def _writable(path: Path) -> None:
    for directory, _, _ in os.walk(path):
        os.chmod(directory, 0o755)


class Workspaces:
    """Workspaces and snapshots under one root directory."""

    def __init__(self, root: Path, sandbox: Sandbox) -> None:
        self.root = root.resolve()
        self.sandbox = sandbox
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        for sub in ("workspaces", "snapshots"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            (self.root / sub).chmod(0o755)
        if sandbox.run_uid() is not None:
            # The sandbox runs as another uid: it must be able to reach the workspaces.
            for directory in [self.root, *self.root.parents]:
                if not os.stat(directory).st_mode & stat.S_IXOTH:
                    raise ValueError(
                        f"workspaces root {self.root}: {directory} is not traversable by the "
                        f"sandbox uid {sandbox.run_uid()} (chmod o+x {directory}, or choose "
                        "another envs.workspaces_dir)"
                    )
        self._tasks: dict[str, common_pb2.Task | None] = {}
        self._lock = threading.Lock()

    # Identity ---------------------------------------------------------------------------
    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{secrets.token_hex(6)}"

    def path(self, workspace_id: str) -> Path:
        """The directory of a workspace or snapshot; NotFound when unknown."""
        kind = "snapshots" if workspace_id.startswith("snap-") else "workspaces"
        path = self.root / kind / workspace_id
        if "/" in workspace_id or not path.is_dir():
            raise NotFound(f"workspace {workspace_id} does not exist")
        return path

    def get(self, workspace_id: str) -> Workspace:
        """A workspace by id."""
        return Workspace(workspace_id, self.path(workspace_id), self._tasks.get(workspace_id))

    # Lifecycle ----------------------------------------------------------------------------
    def create(self, task: common_pb2.Task) -> Workspace:
        """A workspace holding the task's files (the hidden grading files stay out)."""
        workspace_id = self._new_id("ws")
        path = self.root / "workspaces" / workspace_id
        path.mkdir()
        for file in task.files:
            target = self._inside(path, file.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(file.content)
            target.chmod(0o755 if file.executable else 0o644)
        self.sandbox.prepare(path)
        with self._lock:
            self._tasks[workspace_id] = task
        return Workspace(workspace_id, path, task)

    def snapshot(self, workspace_id: str) -> str:
        """A frozen copy of a workspace, to fork from."""
        source = self.path(workspace_id)
        snapshot_id = self._new_id("snap")
        target = self.root / "snapshots" / snapshot_id
        shutil.copytree(source, target, symlinks=True)
        if os.geteuid() == 0:
            for directory, dirs, files in os.walk(target):
                for name in [*dirs, *files, "."]:
                    os.lchown(os.path.join(directory, name), 0, 0)
        _freeze(target)
        with self._lock:
            self._tasks[snapshot_id] = self._tasks.get(workspace_id)
        return snapshot_id

    def fork(self, source_id: str, count: int) -> list[Workspace]:
        """`count` workspaces sharing a snapshot's files (a workspace is snapshotted first)."""
        snapshot_id = source_id if source_id.startswith("snap-") else self.snapshot(source_id)
        snapshot = self.path(snapshot_id)
        directories: list[str] = []
        links: list[tuple[str, str | None]] = []  # (relative path, symlink target or None)
        for directory, dirs, files in os.walk(snapshot):
            relative = os.path.relpath(directory, snapshot)
            directories.extend(os.path.normpath(os.path.join(relative, d)) for d in dirs)
            for name in files:
                source = os.path.join(directory, name)
                target = os.readlink(source) if os.path.islink(source) else None
                links.append((os.path.normpath(os.path.join(relative, name)), target))
        uid = self.sandbox.run_uid()
        forks = []
        for _ in range(count):
            workspace_id = self._new_id("ws")
            path = self.root / "workspaces" / workspace_id
            for relative in ["", *directories]:
                (path / relative).mkdir()
                if uid is not None:
                    os.chown(path / relative, uid, uid)
            for relative, target in links:
                if target is None:
                    os.link(snapshot / relative, path / relative)
                else:
                    os.symlink(target, path / relative)
            with self._lock:
                self._tasks[workspace_id] = self._tasks.get(snapshot_id)
            forks.append(Workspace(workspace_id, path, self._tasks[workspace_id]))
        return forks

    def delete(self, workspace_id: str) -> None:
        """Removes a workspace or snapshot (forks keep their hard-linked files)."""
        path = self.path(workspace_id)
        _writable(path)
        shutil.rmtree(path)
        with self._lock:
            self._tasks.pop(workspace_id, None)

    def size(self, workspace_id: str) -> int:
        """Bytes of the files in a workspace."""
        return sum(
            os.lstat(os.path.join(d, f)).st_size
            for d, _, files in os.walk(self.path(workspace_id))
            for f in files
        )

    # File tools (outside the sandbox) ------------------------------------------------------
    def _inside(self, root: Path, relative: str) -> Path:
        """`relative` resolved inside `root`, or WorkspaceError."""
        if not relative or relative.startswith("/") or "\x00" in relative:
            raise WorkspaceError(f"{relative!r}: paths are relative to the workspace")
        candidate = (root / relative).resolve()
        if candidate != root.resolve() and root.resolve() not in candidate.parents:
            raise WorkspaceError(f"{relative!r} is outside the workspace")
        return candidate

    def read_file(self, workspace_id: str, relative: str, limit: int) -> str:
        """A file's text (at most `limit` bytes)."""
        path = self._inside(self.path(workspace_id), relative)
        if not path.is_file():
            raise WorkspaceError(f"{relative!r} is not a file")
        with path.open("rb") as handle:
            return handle.read(limit).decode("utf-8", errors="replace")

    def write_file(self, workspace_id: str, relative: str, content: str) -> int:
        """Writes a file by replacing it (never in place: forks share files)."""
        path = self._inside(self.path(workspace_id), relative)
        uid = self.sandbox.run_uid()
        missing = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
        for directory in reversed(missing):
            directory.mkdir()
            if uid is not None:
                os.chown(directory, uid, uid)
        temporary = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        temporary.write_text(content)
        if uid is not None:
            os.chown(temporary, uid, uid)
        os.replace(temporary, path)
        return len(content.encode())

    def list_dir(self, workspace_id: str, relative: str) -> list[str]:
        """Entries of a directory ('name/' for directories), sorted."""
        path = self._inside(self.path(workspace_id), relative or ".")
        if not path.is_dir():
            raise WorkspaceError(f"{relative!r} is not a directory")
        return sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
