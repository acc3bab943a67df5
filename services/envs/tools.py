"""The tools the agent calls, and the tool-call grammar.

A call is JSON between the harness's special tokens, e.g.
``<|tool_call|>{"name": "run", "arguments": {"command": "ls"}}<|/tool_call|>``.
Each tool returns text for the model; a malformed call, an unknown tool or bad
arguments return an error text too, so the model can recover — the rollout never
crashes on what the model wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.api.v1 import common_pb2
from services.envs import faults
from services.envs.sandbox import ExecOutcome
from services.envs.workspace import WorkspaceError, Workspaces

TOOL_CALL = re.compile(r"<\|tool_call\|>(.*?)(?:<\|/tool_call\|>|$)", re.DOTALL)
MAX_READ_BYTES = 16 * 1024

Grader = Callable[[str], common_pb2.GradeResult]


@dataclass
class ToolCall:
    """A parsed call, or the reason it could not be parsed."""

    name: str
    arguments: dict[str, Any]
    error: str = ""


@dataclass
class ToolState:
    """What the tools remember across a rollout (the to-do list, finish, files written)."""

    todos: dict[str, bool] = field(default_factory=dict)  # item -> done
    finished: bool = False
    final_message: str = ""
    written: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call in a generated text (an unterminated one is parsed too)."""
    calls = []
    for raw in TOOL_CALL.findall(text):
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError as error:
            calls.append(ToolCall("", {}, f"tool call is not valid JSON: {error.msg}"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(ToolCall("", {}, 'tool call must be {"name": ..., "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(ToolCall(payload["name"], {}, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return calls


def _outcome_text(outcome: ExecOutcome) -> str:
    text = f"exit code {outcome.exit_code}"
    if outcome.timed_out:
        text += " (timed out)"
    elif outcome.killed_by:
        text += f" (killed: {outcome.killed_by})"
    for name, data, cut in (
        ("stdout", outcome.stdout, outcome.stdout_truncated),
        ("stderr", outcome.stderr, outcome.stderr_truncated),
    ):
        if data:
            text += f"\n{name}:\n{data.decode('utf-8', errors='replace')}"
            if cut:
                text += "\n[output truncated]"
    return text


class Tools:
    """The agent's tools over one workspace."""

    names = ("read_file", "write_file", "edit", "list_dir", "run", "run_tests", "todo", "finish")

    def __init__(
        self, workspaces: Workspaces, workspace_id: str, grader: Grader, command_timeout_s: float
    ) -> None:
        self.workspaces = workspaces
        self.workspace_id = workspace_id
        self.grader = grader
        self.command_timeout_s = command_timeout_s
        self.state = ToolState()

    def call(self, call: ToolCall) -> str:
        """Runs one call and returns what the model sees."""
        self.state.calls.append(call.name or "<malformed>")
        if call.error:
            return f"error: {call.error}"
        method = getattr(self, f"_{call.name}", None) if call.name in self.names else None
        if method is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self.names)}"
        try:
            result: str = method(**call.arguments)
        except TypeError as error:
            return f"error: bad arguments for {call.name}: {error}"
        except WorkspaceError as error:
            return f"error: {error}"
        return result

    def _read_file(self, path: str) -> str:
        return self.workspaces.read_file(self.workspace_id, path, MAX_READ_BYTES)

    def _write_file(self, path: str, content: str) -> str:
        size = self.workspaces.write_file(self.workspace_id, path, content)
        self.state.written.add(path)
        return f"wrote {path} ({size} bytes)"

    def _edit(self, path: str, old: str, new: str) -> str:
        text = self.workspaces.read_file(self.workspace_id, path, 1 << 30)
        count = text.count(old) if old else 0
        if count != 1:
            return f"error: the text to replace occurs {count} times in {path} (it must occur once)"
        self.workspaces.write_file(self.workspace_id, path, text.replace(old, new))
        self.state.written.add(path)
        return f"edited {path}"

    def _list_dir(self, path: str = ".") -> str:
        return "\n".join(self.workspaces.list_dir(self.workspace_id, path)) or "(empty)"

    def _run(self, command: str) -> str:
        outcome = self.workspaces.sandbox.run(
            self.workspaces.path(self.workspace_id),
            ["sh", "-c", command],
            wall_s=self.command_timeout_s,
        )
        # A sandbox that did not start or was killed from outside is the host's doing: the
        # rollout is retried rather than the agent shown what its command never did.
        faults.check_infra(outcome)
        return _outcome_text(outcome)

    def _run_tests(self) -> str:
        grade = self.grader(self.workspace_id)
        if grade.failure_reason:
            return f"tests did not run to the end: {grade.failure_reason}"
        return f"{grade.num_passed} of {grade.num_tests} tests passed"

    def _todo(self, action: str, item: str) -> str:
        if action == "add":
            self.state.todos.setdefault(item, False)
        elif action == "complete":
            if item not in self.state.todos:
                return f"error: no to-do item {item!r}"
            self.state.todos[item] = True
        else:
            return "error: action must be 'add' or 'complete'"
        open_items = [name for name, done in self.state.todos.items() if not done]
        return f"{len(open_items)} open: " + "; ".join(open_items) if open_items else "all done"

    def _finish(self, message: str = "") -> str:
        self.state.finished = True
        self.state.final_message = message
        return "finished"
