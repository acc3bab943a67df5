"""`etude bench envs`: how fast a rollout gets its workspace, and what a sandbox costs.

* ``fork_ms``: median time to fork one workspace from a snapshot of a 10 MB,
  1,000-file tree (20 directories of 50 files of 10 KB), against ``cp_r_ms``, a plain
  ``cp -r`` of the same tree in the same run (target: ``fork_ms`` <= 50);
* ``snapshot_ms``: freezing a workspace into a snapshot (a full copy, done once per task);
* ``sandbox_exec_ms``: ``true`` in the sandbox against ``bare_exec_ms``, the same
  command as a plain subprocess;
* ``grade_ms``: grading one canonical synthetic solution (workspace, hidden tests,
  runner, sandbox, teardown) end to end.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.api.v1 import common_pb2
from services.bench import BenchResult
from services.config.envs import SandboxConfig
from services.envs.grading import grade_files
from services.envs.sandbox import make_sandbox
from services.envs.workspace import Workspaces
from services.families import load_family

TARGET_FORK_MS = 50.0
NUM_DIRECTORIES = 20
FILES_PER_DIRECTORY = 50
FILE_BYTES = 10 * 1024


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _tree_task() -> common_pb2.Task:
    files = [
        common_pb2.WorkspaceFile(
            path=f"pkg{d:02d}/module{f:02d}.py", content=bytes([65 + (d + f) % 26]) * FILE_BYTES
        )
        for d in range(NUM_DIRECTORIES)
        for f in range(FILES_PER_DIRECTORY)
    ]
    return common_pb2.Task(task_id="bench/tree", family="bench", files=files)


def run(quick: bool) -> BenchResult:
    """Fork, snapshot, exec and grade figures against cp -r and a bare subprocess."""
    repeats = 5 if quick else 20
    # The sandbox uid must traverse every directory above the root: /tmp, not pytest's.
    root = Path(tempfile.mkdtemp(prefix="etude-bench-envs-", dir="/tmp"))
    try:
        root.chmod(0o755)
        sandbox = make_sandbox(SandboxConfig(allow_unsafe_local=True))
        workspaces = Workspaces(root, sandbox)
        source = workspaces.create(_tree_task())
        snapshot_ms = _median_ms(lambda: workspaces.snapshot(source.workspace_id), 3)
        snapshot_id = workspaces.snapshot(source.workspace_id)
        snapshot_path = workspaces.path(snapshot_id)
        forks: list[str] = []
        fork_ms = _median_ms(
            lambda: forks.extend(w.workspace_id for w in workspaces.fork(snapshot_id, 1)), repeats
        )
        copies = root / "copies"
        copies.mkdir()
        counter = iter(range(repeats))
        cp_r_ms = _median_ms(
            lambda: subprocess.run(
                ["cp", "-r", str(snapshot_path), str(copies / str(next(counter)))], check=True
            ),
            repeats,
        )
        exec_ms = _median_ms(lambda: sandbox.run(source.path, ["true"]), repeats)
        bare_ms = _median_ms(lambda: subprocess.run(["true"], cwd=source.path), repeats)
        family = load_family("synthetic")
        task = family.task("synthetic/heldout/00002")  # a level-2 task: a loop and a test
        completion = family.canonical_completion(task) or ""
        files = family.solution_files(task, completion)
        grade_ms = _median_ms(lambda: grade_files(workspaces, task, files), max(3, repeats // 2))
        graded = grade_files(workspaces, task, files)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    num_files = NUM_DIRECTORIES * FILES_PER_DIRECTORY
    return BenchResult(
        figures={
            "fork_ms": round(fork_ms, 3),
            "fork_vs_cp_r": round(fork_ms / cp_r_ms, 4),
            "snapshot_ms": round(snapshot_ms, 3),
            "sandbox_exec_ms": round(exec_ms, 3),
            "sandbox_overhead_ratio": round(exec_ms / bare_ms, 2),
            "grade_ms": round(grade_ms, 3),
        },
        baseline={"cp_r_ms": round(cp_r_ms, 3), "bare_exec_ms": round(bare_ms, 3)},
        ok=fork_ms <= TARGET_FORK_MS and graded.all_passed,
        target=f"fork_ms <= {TARGET_FORK_MS:g} for a 10 MB / 1,000-file tree",
        details={
            "tree": {"files": num_files, "bytes": num_files * FILE_BYTES},
            "sandbox": sandbox.name,
            "repeats": repeats,
        },
    )
