"""`etude envs run | grade | canonical` as a person runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "vllm", "transformers", "grpc", "opentelemetry", "fastapi")


@pytest.fixture
def root() -> Iterator[Path]:
    """A directory the sandbox uid can traverse (pytest's tmp_path is mode 700)."""
    path = Path(tempfile.mkdtemp(prefix="etude-cli-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _etude(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_envs_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "sys.argv = ['etude', 'envs', 'grade', '--help']\n"
        "from services.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "--solutions" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_run_prints_the_outcome_as_json(root: Path) -> None:
    (root / "data.txt").write_text("from the workspace")
    done = _etude(
        "envs",
        "run",
        "--workspace",
        str(root),
        "--timeout",
        "20",
        "--",
        "python3",
        "-c",
        "import sys; print(open('data.txt').read()); print('oops', file=sys.stderr); sys.exit(3)",
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert {k: outcome[k] for k in ("exit_code", "stdout", "stderr", "timed_out", "killed_by")} == {
        "exit_code": 3,
        "stdout": "from the workspace\n",
        "stderr": "oops\n",
        "timed_out": False,
        "killed_by": "",
    }
    done = _etude("envs", "run", "--workspace", str(root), "--timeout", "1", "--", "sleep", "30")
    outcome = json.loads(done.stdout)
    assert (outcome["timed_out"], outcome["killed_by"]) == (True, "wall_clock")


def test_run_refuses_a_workspace_it_cannot_use(root: Path) -> None:
    done = _etude("envs", "run", "--workspace", str(root / "missing"), "--", "true")
    assert done.returncode == 2 and "is not a directory" in done.stderr
    private = root / "private"
    (private / "inner").mkdir(parents=True)
    private.chmod(0o700)
    done = _etude("envs", "run", "--workspace", str(private / "inner"), "--", "true")
    assert done.returncode == 2 and "not traversable by the sandbox uid" in done.stderr


def test_grade_scores_canonical_and_wrong_synthetic_solutions(root: Path) -> None:
    done = _etude("envs", "canonical", "--suite", "synthetic", "--split", "heldout")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 200
    chosen = [json.loads(line) for line in lines[:6]]
    wrong = {"task_id": chosen[0]["task_id"], "completion": "def nothing():\n    pass\n"}
    solutions = root / "solutions.jsonl"
    solutions.write_text("\n".join(json.dumps(s) for s in [*chosen, wrong]) + "\n")
    done = _etude("envs", "grade", "--suite", "synthetic", "--solutions", str(solutions), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["num_solutions"], report["num_passed"]) == (7, 6)
    assert report["pass_rate"] == pytest.approx(6 / 7)
    assert [r["reward"] for r in report["results"]] == [1.0] * 6 + [0.0]
    assert report["results"][-1]["failure_reason"] == "import_error"
    done = _etude("envs", "grade", "--suite", "synthetic", "--solutions", str(solutions))
    assert done.returncode == 0 and "6/7 passed" in done.stdout


def test_grade_humaneval_in_the_human_eval_format(root: Path) -> None:
    done = _etude("envs", "canonical", "--suite", "humaneval")
    canonical = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(canonical) == 164
    samples = [*canonical[:4], {"task_id": "HumanEval/5", "completion": ""}]
    solutions = root / "samples.jsonl"
    solutions.write_text("".join(json.dumps(s) + "\n" for s in samples))
    done = _etude("envs", "grade", "--suite", "humaneval", "--solutions", str(solutions), "--json")
    report = json.loads(done.stdout)
    assert report["pass_rate"] == pytest.approx(0.8)
    assert [(r["task_id"], r["passed"]) for r in report["results"]] == [
        ("HumanEval/0", True),
        ("HumanEval/1", True),
        ("HumanEval/2", True),
        ("HumanEval/3", True),
        ("HumanEval/5", False),
    ]


def test_grade_refuses_bad_input_naming_it(root: Path) -> None:
    bad = root / "bad.jsonl"
    bad.write_text('{"task_id": "HumanEval/0", "completion": "x"}\nnot json\n')
    done = _etude("envs", "grade", "--suite", "humaneval", "--solutions", str(bad))
    assert done.returncode == 2 and f"{bad}:2" in done.stderr
    bad.write_text('{"task_id": "HumanEval/999", "completion": ""}\n')
    done = _etude("envs", "grade", "--suite", "humaneval", "--solutions", str(bad))
    assert done.returncode == 2 and "HumanEval/999" in done.stderr
    done = _etude("envs", "grade", "--suite", "mbpp", "--solutions", str(bad))
    assert done.returncode == 2 and "unknown task family 'mbpp'" in done.stderr


def test_bench_envs_contract() -> None:
    done = _etude("bench", "envs", "--quick", "--json")
    result = json.loads(done.stdout)
    assert result["bench"] == "envs" and result["ok"] == (done.returncode == 0)
    assert set(result["figures"]) >= {"fork_ms", "fork_vs_cp_r", "snapshot_ms", "grade_ms"}
    assert set(result["baseline"]) == {"cp_r_ms", "bare_exec_ms"}
    assert result["details"]["tree"] == {"files": 1000, "bytes": 10 * 1024 * 1000}
    assert all(value > 0 for value in result["figures"].values())
