"""The agent's tools over a real sandboxed workspace."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.api.v1 import common_pb2
from services.config.envs import SandboxConfig
from services.envs.sandbox import make_sandbox
from services.envs.tools import ToolCall, Tools
from services.envs.workspace import Workspaces


@pytest.fixture
def workspaces() -> Iterator[Workspaces]:
    # The sandbox uid must traverse every directory above the workspaces: not pytest's.
    root = Path(tempfile.mkdtemp(prefix="etude-ws-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield Workspaces(root, make_sandbox(SandboxConfig(wall_s=10)))
    finally:
        for directory, _, _ in os.walk(root):
            os.chmod(directory, 0o755)
        shutil.rmtree(root)


def make_tools(workspaces: Workspaces) -> Tools:
    task = common_pb2.Task(
        task_id="t",
        family="synthetic",
        files=[common_pb2.WorkspaceFile(path="solution.py", content=b"def f(x):\n    return x\n")],
    )
    workspace = workspaces.create(task)
    (fork,) = workspaces.fork(workspace.workspace_id, 1)
    grades = iter([common_pb2.GradeResult(num_tests=3, num_passed=2, score=2 / 3)])
    return Tools(workspaces, fork.workspace_id, lambda ws: next(grades), command_timeout_s=5)


def call(tools: Tools, name: str, **arguments: object) -> str:
    return tools.call(ToolCall(name, dict(arguments)))


def test_file_tools_edit_a_forked_workspace(workspaces: Workspaces) -> None:
    tools = make_tools(workspaces)
    assert call(tools, "read_file", path="solution.py") == "def f(x):\n    return x\n"
    assert (
        call(tools, "edit", path="solution.py", old="return x", new="return x + 1")
        == "edited solution.py"
    )
    assert "occurs 0 times" in call(tools, "edit", path="solution.py", old="nope", new="")
    assert call(tools, "write_file", path="pkg/util.py", content="A = 1\n").startswith(
        "wrote pkg/util.py"
    )
    assert call(tools, "list_dir") == "pkg/\nsolution.py"
    output = call(
        tools,
        "run",
        command="python3 -c 'import solution, pkg.util; print(solution.f(2) + pkg.util.A)'",
    )
    assert output.startswith("exit code 0") and "stdout:\n4" in output
    assert tools.state.written == {"solution.py", "pkg/util.py"}


@pytest.mark.slow
def test_tools_refuse_escapes_and_report_errors(workspaces: Workspaces) -> None:
    tools = make_tools(workspaces)
    assert "outside the workspace" in call(tools, "read_file", path="../../etc/passwd")
    assert "relative to the workspace" in call(tools, "write_file", path="/etc/passwd", content="x")
    call(tools, "run", command="ln -s /etc/passwd leak")
    assert "outside the workspace" in call(tools, "read_file", path="leak")
    assert call(tools, "nope").startswith("error: unknown tool 'nope'")
    assert call(tools, "read_file").startswith("error: bad arguments for read_file")
    assert (
        tools.call(ToolCall("", {}, "tool call is not valid JSON"))
        == "error: tool call is not valid JSON"
    )
    slow = call(tools, "run", command="sleep 30")
    assert "timed out" in slow


def test_todo_tests_and_finish(workspaces: Workspaces) -> None:
    tools = make_tools(workspaces)
    assert call(tools, "todo", action="add", item="write f") == "1 open: write f"
    call(tools, "todo", action="add", item="test f")
    assert call(tools, "todo", action="complete", item="write f") == "1 open: test f"
    assert "no to-do item" in call(tools, "todo", action="complete", item="other")
    assert call(tools, "run_tests") == "2 of 3 tests passed"
    assert call(tools, "finish", message="done") == "finished"
    assert tools.state.finished and tools.state.final_message == "done"
    assert tools.state.todos == {"write f": True, "test f": False}
