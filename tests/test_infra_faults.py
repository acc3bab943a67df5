"""No infrastructure fault becomes a reward: what the sandbox host does to a rollout is
retried and never trained on; what the code does is scored.

The rollout test runs the real reconciler (on Redis), the real envs rollout worker, the
bubblewrap sandbox and the grader; the model alone is a scripted stand-in
(``tests.evals_support``) that writes the right solution, so every graded rollout scores
1 and a 0 could only come from a fault. Sandboxes are killed from outside, as the OOM
killer or an operator would; CPU starvation is made by burners pinned to the CPU the
grading runs on, so the rest of the machine is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.envs import SandboxConfig
from services.envs import sandbox as sandbox_module
from services.envs.faults import (
    INFRA_PREFIX,
    InfraFault,
    InfraKind,
    check_infra,
    slot_faults,
)
from services.envs.grading import grade_files
from services.envs.sandbox import START_SIGNAL, make_sandbox
from services.envs.tools import ToolCall, Tools
from services.envs.workspace import Workspaces
from services.families import RUNNER_PATH
from services.families.synthetic import make_task
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel
from tests.conftest import TOKEN
from tests.evals_support import ScriptedStack
from tests.reconciler_support import reconciler

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def infra_faults(kind: str) -> float:
    return REGISTRY.get_sample_value("etude_envs_infra_faults_total", {"kind": kind}) or 0.0


def timeouts(verdict: str) -> float:
    value = REGISTRY.get_sample_value("etude_envs_grading_timeouts_total", {"verdict": verdict})
    return value or 0.0


@pytest.fixture
def workspaces() -> Iterator[Workspaces]:
    root = Path(tempfile.mkdtemp(prefix="etude-faults-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield Workspaces(root, make_sandbox(SandboxConfig(wall_s=30)))
    finally:
        for directory, _, _ in os.walk(root):
            os.chmod(directory, 0o755)
        shutil.rmtree(root)


def program_task(source: str, timeout_s: float) -> tuple[common_pb2.Task, common_pb2.WorkspaceFile]:
    """A task graded by running `source` (scored by its exit code), and that solution."""
    task = common_pb2.Task(
        task_id="faults/0",
        family="synthetic",
        instruction="Make solution.py run.",
        grading=common_pb2.GradingSpec(
            command=["python3", "solution.py"],
            timeout_s=timeout_s,
            reward_mode=common_pb2.REWARD_MODE_ALL_PASS,
        ),
    )
    return task, common_pb2.WorkspaceFile(path="solution.py", content=source.encode())


@contextlib.contextmanager
def one_busy_cpu(num_burners: int) -> Iterator[None]:
    """Pins this thread (and so the sandboxes it starts) to one CPU and keeps that CPU busy
    with `num_burners` spinning processes, stopped by their PIDs afterwards. Each burner
    has a session of its own: with autogroup scheduling a session shares one CPU slice."""
    before = os.sched_getaffinity(0)
    cpu = max(before)
    os.sched_setaffinity(0, {cpu})
    burners = [
        subprocess.Popen(["python3", "-c", "while True: pass"], start_new_session=True)
        for _ in range(num_burners)
    ]
    try:
        time.sleep(0.5)  # the burners are spinning before the grading starts
        yield
    finally:
        for burner in burners:
            os.kill(burner.pid, signal.SIGKILL)
            burner.wait()
        os.sched_setaffinity(0, before)


def test_a_solution_that_loops_forever_scores_zero(
    workspaces: Workspaces, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loaded test machine may starve the loop's first run: the re-run judges it by CPU
    # time, and a generous wall clock lets it reach its CPU limit even here.
    monkeypatch.setattr(sandbox_module, "JUDGE_WALL_FACTOR", 20)
    task, solution = program_task("while True:\n    pass\n", timeout_s=1)
    loops, reruns = timeouts("code_loop"), timeouts("rerun_code_loop")
    result = grade_files(workspaces, task, [solution])
    assert result.failure_reason == "timeout"
    assert result.score == 0.0 and result.exec.timed_out
    assert timeouts("code_loop") + timeouts("rerun_code_loop") == loops + reruns + 1


def test_a_program_that_sleeps_past_its_limit_twice_scores_zero(workspaces: Workspaces) -> None:
    """The rule for sleeping programs: no CPU used and none waited for, in two sandboxes
    (the second with three times the wall clock), is the code's stall, not the host's."""
    task, solution = program_task("import time\ntime.sleep(1000)\n", timeout_s=1)
    stalls = timeouts("rerun_code_stalled")
    started = time.perf_counter()
    result = grade_files(workspaces, task, [solution])
    assert result.failure_reason == "timeout" and result.score == 0.0
    assert timeouts("rerun_code_stalled") == stalls + 1
    # One run under the wall clock, one re-run under JUDGE_WALL_FACTOR times it.
    assert time.perf_counter() - started < 1 + sandbox_module.JUDGE_WALL_FACTOR + 10


@pytest.mark.slow
def test_a_starved_innocent_program_is_the_hosts_fault(workspaces: Workspaces) -> None:
    # 0.6 CPU-seconds of work under a 1 s limit: it fits, unless the host starves it.
    source = (
        "import time\nstart = time.process_time()\n"
        "while time.process_time() - start < 0.6:\n    pass\n"
    )
    task, solution = program_task(source, timeout_s=1)
    overloaded = timeouts("rerun_host_overloaded") + timeouts("host_overloaded")
    with one_busy_cpu(num_burners=12), pytest.raises(InfraFault) as fault:
        grade_files(workspaces, task, [solution])
    assert fault.value.kind is InfraKind.HOST_OVERLOADED
    # Judged by its re-run, or (on a machine this loaded) before its sandbox was set up.
    assert timeouts("rerun_host_overloaded") + timeouts("host_overloaded") == overloaded + 1


def test_exit_code_137_is_the_codes_own_not_a_kill(workspaces: Workspaces) -> None:
    """bwrap reports a command killed by SIGKILL as 137; the code cannot forge a kill
    from outside by exiting with that code, nor by sending itself SIGKILL (it is pid 1
    of its namespace)."""
    for source in ("import os\nos._exit(137)\n", "import os\nos.kill(os.getpid(), 9)\n"):
        task, solution = program_task(source, timeout_s=10)
        result = grade_files(workspaces, task, [solution])
        assert result.exec.killed_by == ""
    task, solution = program_task("import os\nos._exit(137)\n", timeout_s=10)
    assert grade_files(workspaces, task, [solution]).score == 0.0


def test_a_sandbox_that_cannot_start_is_the_hosts_fault(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # bwrap, run as the sandbox uid, cannot bind it
    outcome = make_sandbox(SandboxConfig(wall_s=10)).run(private, ["true"])
    assert not outcome.started and outcome.stderr.startswith(b"bwrap:")
    with pytest.raises(InfraFault) as fault:
        check_infra(outcome)
    assert fault.value.kind is InfraKind.SANDBOX_START


def test_slot_faults_count_every_failed_attempt() -> None:
    complete, dead = reconciler_pb2.SLOT_STATE_COMPLETE, reconciler_pb2.SLOT_STATE_DEAD
    cases = [
        (reconciler_pb2.SlotInfo(state=complete, attempts=1), (0, "")),
        (
            reconciler_pb2.SlotInfo(
                state=complete, attempts=3, last_failure="infra:host_overloaded: starved"
            ),
            (2, "host_overloaded"),
        ),
        (
            reconciler_pb2.SlotInfo(state=dead, attempts=3, last_failure="lease expired"),
            (3, "lease_expired"),
        ),
        (
            reconciler_pb2.SlotInfo(state=dead, attempts=1, last_failure="record corrupt"),
            (1, "other"),
        ),
    ]
    for slot, expected in cases:
        assert slot_faults(slot) == expected


class SandboxKiller:
    """Kills, from outside, the first `num_kills` started sandboxes whose command line
    carries `marker` (their pid 1: the whole sandbox goes), as the OOM killer would.

    A sandbox counts as started once its start-pipe wrapper has exec'd the command: a
    kill before that is a sandbox that never started (sandbox_start), another fault."""

    def __init__(self, marker: str, num_kills: int) -> None:
        self.marker = marker.encode()
        self.num_kills = num_kills
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> SandboxKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _sandbox_init(self, pid: str) -> bool:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        if self.marker not in cmdline or START_SIGNAL.encode() in cmdline:
            return False
        nspids = next(line for line in status.splitlines() if line.startswith("NSpid:"))
        return nspids.split()[-1] == "1" and len(nspids.split()) > 2

    def _watch(self) -> None:
        while not self._stop.is_set() and len(self.killed) < self.num_kills:
            for pid in os.listdir("/proc"):
                if pid.isdigit() and int(pid) not in self.killed and self._sandbox_init(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                        self.killed.append(int(pid))
                    break
            time.sleep(0.02)


def test_an_agent_command_killed_from_outside_fails_the_attempt(workspaces: Workspaces) -> None:
    task, _ = program_task("", timeout_s=10)
    workspace = workspaces.create(task)
    marker = f"etude-kill-me-{uuid.uuid4().hex[:8]}"
    tools = Tools(workspaces, workspace.workspace_id, lambda _: common_pb2.GradeResult(), 10)
    try:
        assert tools.call(ToolCall("run", {"command": "exit 137"})) == "exit code 137"
        with SandboxKiller(marker, 1), pytest.raises(InfraFault) as fault:
            tools.call(ToolCall("run", {"command": f"sleep 5; true {marker}"}))
        assert fault.value.kind is InfraKind.KILLED_OUTSIDE
    finally:
        workspaces.delete(workspace.workspace_id)


@pytest.mark.integration
def test_sandboxes_killed_from_outside_are_retried_never_trained(
    tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    task = make_task("train", 0, seed=0)
    marker = f"etude-kill-me-{uuid.uuid4().hex[:8]}"
    # The grading first sleeps a second (the window in which a sandbox is killed), then
    # runs the task's own tests.
    tests = task.grading.hidden_files[0].path
    del task.grading.command[:]
    task.grading.command.extend(
        ["sh", "-c", 'sleep 1; exec python3 "$@"', marker, RUNNER_PATH, tests]
    )
    num_samples, num_kills = 4, 2
    before = infra_faults("killed_outside")
    run_name = f"faults-{uuid.uuid4().hex[:8]}"
    with (
        reconciler(tmp_path, run_name=run_name) as control,
        ScriptedStack(
            reconciler_target=control.target,
            store_dir=tmp_path / "store",
            run_name=run_name,
            tokenizer=AutoTokenizer.from_pretrained(tiny_model),
            tasks=[task],
            plan={0: {task.task_id: ["right"] * (num_samples + num_kills)}},
            concurrency=2,
        ),
        SandboxKiller(marker, num_kills) as killer,
    ):

        async def run() -> reconciler_pb2.Group:
            async with make_channel(control.target, token=TOKEN) as channel:
                future = await ReconcilerClient(channel).submit(task, num_samples)
                async with asyncio.timeout(240):
                    return await future.result()

        group = asyncio.run(run())
    assert len(killer.killed) == num_kills
    # Every slot completed with the right solution's score: no killed grading was
    # scored 0, and each kill cost its slot one retried attempt.
    assert len(group.rollouts) == num_samples
    assert all(r.grade.score == 1.0 and r.reward.task == 1.0 for r in group.rollouts)
    retried = [s for s in group.slots if s.attempts > 1]
    assert sum(s.attempts - 1 for s in group.slots) == num_kills
    assert all(s.last_failure.startswith(f"{INFRA_PREFIX}killed_outside:") for s in retried)
    # What the trainer reads for the step's fault rate.
    faults = [slot_faults(s) for s in group.slots]
    assert sum(n for n, _ in faults) == num_kills
    assert {kind for n, kind in faults if n} == {"killed_outside"}
    attempts = {r.sample_index: r.rollout_id.rsplit("-a", 1)[1] for r in group.rollouts}
    assert {s.sample_index: str(s.attempts) for s in group.slots} == attempts
    # Counted once per faulted attempt.
    assert infra_faults("killed_outside") == before + num_kills
