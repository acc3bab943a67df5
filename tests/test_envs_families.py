"""Task families and grading, end to end through the real sandbox.

Canonical solutions must pass and wrong ones fail; code that loops, floods, crashes or
tries to forge a result must score 0 without disturbing the grader; hidden files must
never stay in a workspace.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.api.v1 import common_pb2
from services.config.envs import SandboxConfig
from services.envs.faults import InfraFault, InfraKind
from services.envs.grading import grade, grade_files
from services.envs.sandbox import make_sandbox
from services.envs.workspace import Workspaces
from services.families import GRADING_DIR, TaskFamily, load_family
from services.families.humaneval import HumanEvalFamily
from services.families.multifile import MultiFileFamily, parts_of
from services.families.repo import RepoFamily
from services.families.synthetic import (
    SyntheticFamily,
    is_novel,
    is_training_name,
    make_task,
    task_at,
)
from services.messages import validate_task


@pytest.fixture(scope="module")
def workspaces() -> Iterator[Workspaces]:
    """Workspaces under /tmp (the sandbox uid must traverse every directory above)."""
    root = Path(tempfile.mkdtemp(prefix="etude-ws-", dir="/tmp"))
    root.chmod(0o755)
    yield Workspaces(root / "envs", make_sandbox(SandboxConfig()))
    shutil.rmtree(root, ignore_errors=True)


def _grade_all(
    workspaces: Workspaces, jobs: Sequence[tuple[common_pb2.Task, str]], family: TaskFamily
) -> list[common_pb2.GradeResult]:
    """Grades (task, completion) pairs on four threads (sandbox runs are subprocesses)."""
    with ThreadPoolExecutor(4) as pool:
        return list(
            pool.map(lambda job: grade_files(workspaces, job[0], family.solution_files(*job)), jobs)
        )


# Synthetic ---------------------------------------------------------------------------------
def test_synthetic_tasks_are_deterministic_per_seed() -> None:
    first = SyntheticFamily(seed=3, num_train=40, num_heldout=10, num_novel=10)
    again = SyntheticFamily(seed=3, num_train=40, num_heldout=10, num_novel=10)
    other = SyntheticFamily(seed=4, num_train=40, num_heldout=10, num_novel=10)
    for split in ("train", "heldout", "novel"):
        serialized = [t.SerializeToString() for t in first.tasks(split)]
        assert serialized == [t.SerializeToString() for t in again.tasks(split)]
        assert serialized != [t.SerializeToString() for t in other.tasks(split)]
    assert task_at(17, 3) == first.tasks("train")[17] == first.task("synthetic/train/00017")
    assert first.task("synthetic/heldout/00004") == first.tasks("heldout")[4]
    with pytest.raises(KeyError, match="synthetic/<split>/<n>"):
        first.task("HumanEval/3")
    with pytest.raises(ValueError, match="train, heldout, novel"):
        first.tasks("test")


def test_synthetic_splits_heldout_instances_and_novel_behaviours() -> None:
    splits = {
        split: [make_task(split, p, 0) for p in range(count)]
        for split, count in (("train", 400), ("heldout", 100), ("novel", 100))
    }
    behaviours = {
        split: {t.metadata["behaviour"] for t in tasks} for split, tasks in splits.items()
    }
    # No training task has a novel behaviour; heldout is new instances of trained ones.
    assert not behaviours["novel"] & (behaviours["train"] | behaviours["heldout"])
    assert all(is_novel(b) for b in behaviours["novel"])
    assert not any(is_novel(b) for b in behaviours["train"] | behaviours["heldout"])
    assert len(behaviours["heldout"] & behaviours["train"]) >= len(behaviours["heldout"]) // 2
    # ...but never a training task: their function names are ones training never uses.
    names = {split: {t.metadata["entry_point"] for t in tasks} for split, tasks in splits.items()}
    assert all(is_training_name(n) for n in names["train"])
    assert not any(is_training_name(n) for n in names["heldout"] | names["novel"])
    for tasks in splits.values():
        assert {t.metadata["level"] for t in tasks} == {"0", "1", "2", "3"}
        assert len({t.task_id for t in tasks}) == len(tasks)
        for task in tasks:
            validate_task(task, "task")
            assert task.difficulty == int(task.metadata["level"]) / 3
            assert task.metadata["entry_point"] in task.instruction
            assert "Example:" in task.instruction
    # Train draws every template of every level.
    assert len({b.split(":")[0] for b in behaviours["train"]}) >= 13


def test_synthetic_canonical_solutions_pass_and_wrong_ones_fail(workspaces: Workspaces) -> None:
    family = SyntheticFamily(seed=0, num_train=60, num_heldout=40)
    tasks = family.tasks("train") + family.tasks("heldout")
    canonical = [(t, family.canonical_completion(t) or "") for t in tasks]
    wrong = [(t, f"def {t.metadata['entry_point']}(*args):\n    return None\n") for t in tasks[:24]]
    results = _grade_all(workspaces, canonical + wrong, family)
    for (task, _), result in zip(canonical, results[: len(tasks)], strict=True):
        assert (result.score, result.all_passed) == (1.0, True), (task.task_id, result)
        assert result.num_tests == result.num_passed >= 1
    for (task, _), result in zip(wrong, results[len(tasks) :], strict=True):
        assert result.score == 0.0 and not result.all_passed, (task.task_id, result)
        assert result.failure_reason == "" and result.num_passed == 0
        assert b"FAILED test_1" in result.exec.stdout  # the runner's report, for the agent


def test_synthetic_partial_solutions_earn_the_fraction_that_passes(
    workspaces: Workspaces,
) -> None:
    family = SyntheticFamily(seed=0)
    task = family.task("synthetic/train/00001")  # level 1: x <op> k, four calls
    assert task.metadata["level"] == "1" and len(task.grading.hidden_files) == 1
    name = task.metadata["entry_point"]
    first_call = task.instruction.split(f"Example: {name}(")[1].split(")")[0]
    canonical = (family.canonical_completion(task) or "").replace(name, "_right")
    only_the_example = f"args == ({first_call},)"
    partial = (
        f"{canonical}\n\ndef {name}(*args):\n"
        f"    return _right(*args) if {only_the_example} else None\n"
    )
    result = grade_files(workspaces, task, family.solution_files(task, partial))
    assert result.failure_reason == "" and result.num_tests == 4
    assert 0 < result.score < 1 and result.score == result.num_passed / result.num_tests
    # The untouched stub scores 0: its function returns None.
    workspace = workspaces.create(task)
    try:
        stub = grade(workspaces, workspace.workspace_id, task.grading)
    finally:
        workspaces.delete(workspace.workspace_id)
    assert (stub.score, stub.failure_reason, stub.num_passed) == (0.0, "", 0)


# HumanEval ---------------------------------------------------------------------------------
def test_humaneval_canonical_solutions_score_164_of_164(workspaces: Workspaces) -> None:
    family = HumanEvalFamily()
    tasks = family.tasks("heldout")
    assert len(tasks) == 164 and tasks[0].task_id == "HumanEval/0"
    assert tasks[163].task_id == "HumanEval/163"
    results = _grade_all(
        workspaces, [(t, family.canonical_completion(t) or "") for t in tasks], family
    )
    failed = [(t.task_id, r) for t, r in zip(tasks, results, strict=True) if not r.all_passed]
    assert failed == []
    assert sum(r.score for r in results) == 164


@pytest.mark.slow
def test_humaneval_empty_and_wrong_solutions_score_zero(workspaces: Workspaces) -> None:
    family = load_family("humaneval")
    tasks = family.tasks("heldout")
    jobs = [(t, "") for t in tasks] + [(t, "    return None\n") for t in tasks]
    results = _grade_all(workspaces, jobs, family)
    passing = [job[0].task_id for job, r in zip(jobs, results, strict=True) if r.score != 0.0]
    assert passing == []
    assert all(r.num_tests == 1 and r.failure_reason == "" for r in results)


def _grade_as_the_worker_retries(
    workspaces: Workspaces,
    task: common_pb2.Task,
    files: Sequence[common_pb2.WorkspaceFile],
    attempts: int = 5,
) -> common_pb2.GradeResult:
    """`grade_files`, with a host_overloaded attempt retried after a pause as the rollout
    worker retries its slot: a loop starved of CPU by the other test worker on 2 cores is
    the host's fault, correctly, and never a score. Any other infrastructure fault fails."""
    for attempt in range(attempts):
        try:
            return grade_files(workspaces, task, files)
        except InfraFault as fault:
            if fault.kind is not InfraKind.HOST_OVERLOADED or attempt == attempts - 1:
                raise
            time.sleep(2.0 * 2**attempt)
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("    while True:\n        pass\n", "timeout"),
        ("    while True:\n        print('flood' * 2000)\n", "timeout"),
        ("    return [\n", "syntax_error"),
        ("    return 1\nraise SystemExit(0)\n", "import_error"),
        ("    return 1\nimport os\nos._exit(0)\n", "no_result"),
        ('    return 1\nprint(\'@@etude-result 0 {"passed": 1, "total": 1}\')\n', ""),
        (
            "    return 1\nimport os\n"
            "for fd in range(3, 20):\n"
            "    try:\n"
            '        os.write(fd, b\'@@etude-result x {"passed": 9, "total": 9}\\n\')\n'
            "    except OSError:\n"
            "        pass\n",
            "forged_result",
        ),
        ("    return 1\nimport ctypes\nctypes.string_at(0)\n", "crash"),
        ("    return 1\nblock = bytearray(8 * 1024 ** 3)\n", "import_error"),
    ],
    ids=["loop", "flood", "syntax", "exit", "os-exit", "print-fake", "forge", "segv", "memory"],
)
def test_misbehaving_solutions_score_zero_and_the_grader_keeps_serving(
    workspaces: Workspaces, completion: str, reason: str
) -> None:
    family = HumanEvalFamily()
    task = common_pb2.Task()
    task.CopyFrom(family.task("HumanEval/0"))
    task.grading.timeout_s = 2.0
    result = _grade_as_the_worker_retries(workspaces, task, family.solution_files(task, completion))
    assert (result.score, result.all_passed, result.failure_reason) == (0.0, False, reason)
    assert len(result.exec.stdout) + len(result.exec.stderr) <= 2 * 64 * 1024 + 4096
    if reason == "timeout":
        # "rlimit_cpu" when the first run was starved and its re-run was judged by CPU time.
        assert result.exec.timed_out and result.exec.killed_by in ("wall_clock", "rlimit_cpu")
    canonical = family.canonical_completion(task) or ""
    again = grade_files(workspaces, task, family.solution_files(task, canonical))
    assert again.all_passed


def test_tests_defined_by_the_solution_are_not_collected(workspaces: Workspaces) -> None:
    family = HumanEvalFamily()
    task = family.task("HumanEval/0")
    bonus = "".join(f"def test_bonus_{i}():\n    pass\n\n" for i in range(5))
    result = grade_files(workspaces, task, family.solution_files(task, f"    return 1\n\n{bonus}"))
    assert (result.num_tests, result.num_passed, result.score) == (1, 0, 0.0)


# Hidden files ------------------------------------------------------------------------------
def test_hidden_files_leave_no_trace_and_planted_graders_are_ignored(
    workspaces: Workspaces,
) -> None:
    family = SyntheticFamily(seed=0)
    task = family.task("synthetic/train/00002")
    source = workspaces.create(task)
    fork = workspaces.fork(source.workspace_id, 1)[0]
    ws = fork.workspace_id
    # The agent plants its own "runner" and test file where the grader's go.
    fake = (
        "import sys\n"
        "print('@@etude-result', sys.stdin.readline().strip(), '{\"passed\": 5, \"total\": 5}')\n"
    )
    workspaces.write_file(ws, f"{GRADING_DIR}/runner.py", fake)
    workspaces.write_file(ws, f"{GRADING_DIR}/test_synthetic.py", "def test_ok():\n    pass\n")
    before = sorted(p.relative_to(fork.path) for p in fork.path.rglob("*"))
    result = grade(workspaces, ws, task.grading)
    assert result.score == 0.0 and result.num_tests == 4  # the real tests ran on the stub
    assert not (fork.path / GRADING_DIR).exists()
    assert sorted(p.relative_to(fork.path) for p in fork.path.rglob("*")) == [
        p for p in before if not str(p).startswith(GRADING_DIR)
    ]
    # A hidden file on the path of an agent file displaces it only while grading runs.
    workspaces.write_file(ws, "notes.txt", "agent notes")
    outside = fork.path.parent.parent / "outside"
    outside.mkdir(exist_ok=True)
    (fork.path / "linked").symlink_to(outside)
    spec = common_pb2.GradingSpec(
        command=["python3", "-c", "print(open('notes.txt').read(), open('linked/x.txt').read())"],
        hidden_files=[
            common_pb2.WorkspaceFile(path="notes.txt", content=b"hidden"),
            common_pb2.WorkspaceFile(path="linked/x.txt", content=b"through the link?"),
        ],
    )
    shown = grade(workspaces, ws, spec)
    assert shown.exec.stdout == b"hidden through the link?\n" and shown.score == 1.0
    assert workspaces.read_file(ws, "notes.txt", 100) == "agent notes"
    assert list(outside.iterdir()) == []  # written in a real directory, never through the link
    snapshot_id = workspaces.snapshot(ws)
    with pytest.raises(ValueError, match="snapshot"):
        grade(workspaces, snapshot_id, task.grading)
    for workspace_id in (ws, source.workspace_id, snapshot_id):
        workspaces.delete(workspace_id)


# Repo --------------------------------------------------------------------------------------
_CALC = "def add(a, b):\n    return a - b\n\n\ndef double(a):\n    return 2 * a\n"
_VISIBLE_TEST = (
    "import unittest\n\nfrom calc import add\n\n\n"
    "class TestAdd(unittest.TestCase):\n    def test_add(self):\n"
    "        self.assertEqual(add(2, 3), 5)\n"
)
_HIDDEN_TEST = (
    "from calc import add, double\n\n\ndef test_add():\n    assert add(1, 1) == 2\n\n\n"
    "def test_add_negative():\n    assert add(-1, -1) == -2\n\n\n"
    "def test_double():\n    assert double(4) == 8\n"
)


def _repo_tasks(root: Path) -> Path:
    repo = root / "calc"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(_CALC)
    (repo / "tests" / "test_calc.py").write_text(_VISIBLE_TEST)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "calc"], check=True)
    (repo / "untracked.txt").write_text("not part of the checkout")
    hidden = root / "hidden" / "tests"
    hidden.mkdir(parents=True)
    (hidden / "test_hidden.py").write_text(_HIDDEN_TEST)
    task_file = root / "tasks.toml"
    task_file.write_text(
        "[[tasks]]\n"
        'id = "calc/exit-code"\npath = "calc"\ninstruction = "Fix add."\n'
        'test_command = ["python3", "-m", "unittest", "discover", "-s", "tests"]\n'
        "[[tasks]]\n"
        'id = "calc/counted"\npath = "calc"\ninstruction = "Fix add."\nsplit = "heldout"\n'
        'hidden_tests = "hidden"\nreward_mode = "pass_fraction"\n'
        'test_command = ["python3", ".etude-grading/runner.py", "tests"]\n'
    )
    return task_file


def test_repo_tasks_grade_by_exit_code_or_by_counted_tests(workspaces: Workspaces) -> None:
    root = Path(tempfile.mkdtemp(prefix="etude-repo-", dir="/tmp"))
    try:
        family = RepoFamily(_repo_tasks(root))
        assert family.splits == ("train", "heldout")
        by_exit, counted = family.tasks("train")[0], family.tasks("heldout")[0]
        assert sorted(f.path for f in by_exit.files) == ["calc.py", "tests/test_calc.py"]
        assert [f.path for f in counted.grading.hidden_files] == ["tests/test_hidden.py"]
        broken = _grade_all(workspaces, [(by_exit, "{}"), (counted, "{}")], family)
        assert (broken[0].score, broken[0].num_tests, broken[0].exec.exit_code) == (0.0, 1, 1)
        # Visible and hidden tests together; only test_double passes with the bug.
        assert (broken[1].num_passed, broken[1].num_tests) == (1, 4)
        assert (
            broken[1].score == 0.25 and "FAILED TestAdd.test_add" in broken[1].exec.stdout.decode()
        )
        fix = json.dumps({"calc.py": _CALC.replace("a - b", "a + b")})
        fixed = _grade_all(workspaces, [(by_exit, fix), (counted, fix)], family)
        assert [(r.score, r.all_passed) for r in fixed] == [(1.0, True), (1.0, True)]
        with pytest.raises(ValueError, match="JSON object"):
            family.solution_files(by_exit, "not json")
        (root / "bad.toml").write_text('[[tasks]]\nid = "x"\npath = "calc"\n')
        with pytest.raises(ValueError, match=r"(?s)tasks\[0\].*instruction"):
            RepoFamily(root / "bad.toml")
    finally:
        shutil.rmtree(root)


# Multifile ---------------------------------------------------------------------------------
def test_multifile_tasks_hide_each_function_in_its_file() -> None:
    family = MultiFileFamily(seed=0, num_train=30, num_heldout=20)
    train, heldout = family.tasks("train"), family.tasks("heldout")
    assert [t.SerializeToString() for t in train[:5]] == [
        t.SerializeToString() for t in MultiFileFamily(seed=0, num_train=5).tasks("train")
    ]
    assert MultiFileFamily(seed=1, num_train=1).tasks("train")[0] != train[0]
    assert family.task("multifile/heldout/00007") == heldout[7]
    for task in train + heldout:
        validate_task(task, "task")  # within every request limit a reconciler enforces
        parts = parts_of(task)
        assert [f.path for f in task.files] == ["part_1.py", "part_2.py", "part_3.py"]
        assert [p.path for p in parts] == [f.path for f in task.files]
        for part, file in zip(parts, task.files, strict=True):
            text = file.content.decode()
            # The file alone says what to write; the instruction names only the files.
            assert text.startswith(f"def {part.name}(") and part.description in text
            assert part.name not in task.instruction and part.description not in task.instruction
            assert text.count("    pass\n") == 1
            assert is_training_name(part.name) == (task.split == "train")
    assert len({t.metadata["parts"] for t in train}) == len(train)
    with pytest.raises(ValueError, match="its splits: train, heldout"):
        family.tasks("novel")


def test_multifile_solutions_score_the_fraction_of_parts_filled(workspaces: Workspaces) -> None:
    family = MultiFileFamily(seed=0, num_train=6, num_heldout=6)
    tasks = family.tasks("train") + family.tasks("heldout")
    jobs = []
    for task in tasks:
        canonical = json.loads(family.canonical_completion(task) or "")
        first = parts_of(task)[0].path
        jobs += [(task, json.dumps(canonical)), (task, json.dumps({first: canonical[first]}))]
        jobs.append((task, json.dumps({})))  # the stubs as they are
    results = _grade_all(workspaces, jobs, family)
    for index, task in enumerate(tasks):
        whole, one, none = results[3 * index : 3 * index + 3]
        assert (whole.score, whole.all_passed) == (1.0, True), (task.task_id, whole)
        assert 0 < one.score < 1 and not one.all_passed, (task.task_id, one)
        assert none.score == 0.0, (task.task_id, none)
    with pytest.raises(ValueError, match="multifile completion is a JSON object"):
        family.solution_files(tasks[0], "def f(): pass")


def test_families_are_chosen_by_name() -> None:
    assert isinstance(load_family("synthetic", seed=1), SyntheticFamily)
    assert isinstance(load_family("multifile", seed=1), MultiFileFamily)
    with pytest.raises(ValueError, match="known: humaneval, multifile, repo, synthetic"):
        load_family("mbpp")
    with pytest.raises(KeyError, match="HumanEval/999"):
        HumanEvalFamily().task("HumanEval/999")
    with pytest.raises(ValueError, match="its splits: heldout"):
        HumanEvalFamily().tasks("train")
