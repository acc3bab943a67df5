"""The teacher's transcripts of multifile tasks, written through the real harness.

A multifile task takes more than one context under the local budgets, so its SFT
transcripts must show what the harness does there: ask for a summary, and start the
next context from the task and that summary. Rather than lay those contexts out a second
time, the teacher plays the model's part inside the real ``Harness`` with the real
tools over a real workspace: ``TeacherPolicy`` answers each generation call with the
next step of its plan (read a part, edit its stub, ..., finish) and, when the harness
asks for a summary, with one that says what is done, what it has read but not yet
written (the function and what it must return, which the next context no longer
shows), and what is left. The contexts the harness builds are the SFT examples, in the
model's own token ids with the harness's mask of generated tokens (``{"token_ids",
"loss_mask"}`` lines, ``services.trainer.sft``): nothing is retokenized, and a summary
is trained like any other turn of the context that asked for it.

Every transcript is checked: the workspace the teacher leaves must hold the task's
canonical solution.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.api.v1 import common_pb2
from services.config.envs import HarnessConfig, SandboxConfig
from services.envs.harness import Generation, Harness
from services.envs.sandbox import UnsafeLocalSandbox
from services.envs.tools import Tools
from services.envs.workspace import Workspaces
from services.families import CANONICAL_KEY
from services.families.multifile import STUB_BODY, Part, make_task, parts_of
from services.model_factory.vocabulary import special_token_ids


class TeacherError(RuntimeError):
    """The teacher cannot demonstrate a task under the given budgets."""


@dataclass(frozen=True)
class Step:
    """One action of the teacher's plan."""

    tool: str  # read_file | edit | finish
    part: Part | None


def plan(parts: list[Part]) -> list[Step]:
    """Read a part, fill its stub; the next part; then finish."""
    steps = [Step(tool, part) for part in parts for tool in ("read_file", "edit")]
    return [*steps, Step("finish", None)]


class TeacherPolicy:
    """Answers the harness's generation calls for one task with the teacher's turns."""

    def __init__(self, parts: list[Part], tokenizer: Any) -> None:
        self.parts = parts
        self.steps = plan(parts)
        self.done = 0  # steps taken
        self.tokenizer = tokenizer
        self.special = special_token_ids()
        self.num_summaries = 0

    def _text(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(
            text, add_special_tokens=False, split_special_tokens=True
        )
        return ids

    async def __call__(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: list[int],
        routes_from: int = 0,
        cache_version: int | None = None,
    ) -> Generation:
        special = self.special
        if prompt[-1:] == [special["<|summary|>"]]:
            self.num_summaries += 1
            ids = [*self._text(self.summary()), special["<|/summary|>"]]
        else:
            if self.done == len(self.steps):
                raise TeacherError("the harness asked for a turn after finish")
            step = self.steps[self.done]
            self.done += 1
            ids = [
                special["<|tool_call|>"],
                *self._text(json.dumps(self.call(step))),
                special["<|/tool_call|>"],
                special["<|end_of_turn|>"],
            ]
        if len(ids) > max_tokens:
            raise TeacherError(
                f"a teacher turn of {len(ids)} tokens exceeds the harness's budget of {max_tokens}"
            )
        return Generation(
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            version_spans=[(0, 0, len(ids))],
            routing=None,
            finish_reason="stop",
        )

    @staticmethod
    def call(step: Step) -> dict[str, Any]:
        """The tool call of `step`."""
        if step.part is None:
            return {"name": "finish", "arguments": {"message": "done"}}
        if step.tool == "read_file":
            return {"name": "read_file", "arguments": {"path": step.part.path}}
        return {
            "name": "edit",
            "arguments": {"path": step.part.path, "old": STUB_BODY, "new": step.part.body + "\n"},
        }

    def summary(self) -> str:
        """What is done, what was read but not written (all the next context needs to
        write it), and what is left."""
        taken = self.steps[: self.done]
        edited = [s.part for s in taken if s.tool == "edit" and s.part is not None]
        read = [s.part for s in taken if s.tool == "read_file" and s.part is not None]
        pending = [part for part in read if part not in edited]
        left = [part for part in self.parts if part not in read]
        lines = []
        if edited:
            lines.append("Done: " + ", ".join(p.path for p in edited) + ".")
        for part in pending:
            lines.append(
                f"Read, not yet filled: {part.path}: {part.name}({part.params}) must return "
                f"{part.description}."
            )
        if left:
            lines.append("Left: " + ", ".join(p.path for p in left) + ".")
        else:
            lines.append("Left: nothing to read.")
        return "\n".join(lines)


@dataclass
class Transcript:
    """One task's contexts as SFT lines, and what the rollout did."""

    lines: list[dict[str, list[int]]]
    num_summaries: int
    finish_reason: str


def transcript(task: common_pb2.Task, tokenizer: Any, harness: HarnessConfig) -> Transcript:
    """The teacher's rollout of `task` through the real harness and tools, under the
    budgets of the task's family (`harness.for_family`); TeacherError when it does not
    end finished on the canonical solution."""
    harness = harness.for_family(task.family)
    root = Path(tempfile.mkdtemp(prefix="etude-teacher-"))
    root.chmod(0o755)  # workspaces are the sandbox uid's when run as root
    try:
        # Only read_file, edit and finish run: no command, so no sandbox is started.
        workspaces = Workspaces(root, UnsafeLocalSandbox(SandboxConfig(allow_unsafe_local=True)))
        workspace = workspaces.create(task)
        tools = Tools(workspaces, workspace.workspace_id, _no_grader, command_timeout_s=1.0)
        policy = TeacherPolicy(parts_of(task), tokenizer)
        result = asyncio.run(Harness(policy, tokenizer, harness).run(task, tools))
        if result.finish_reason != "finished":
            raise TeacherError(
                f"{task.task_id}: the teacher's rollout ended {result.finish_reason!r} under "
                f"{harness!r}"
            )
        canonical = json.loads(task.metadata[CANONICAL_KEY])
        for path, text in canonical.items():
            written = workspaces.read_file(workspace.workspace_id, path, 1 << 20)
            if written != text:
                raise TeacherError(f"{task.task_id}: {path} is not the canonical solution")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [
        {
            "token_ids": list(segment.token_ids),
            # The segment's mask starts after its prompt (the context's opening).
            "loss_mask": [0] * segment.num_prompt_tokens + list(segment.generated_mask),
        }
        for segment in result.segments
    ]
    return Transcript(lines, policy.num_summaries, result.finish_reason)


def _no_grader(workspace_id: str) -> common_pb2.GradeResult:
    raise TeacherError("the teacher never runs the tests")


def multifile_sft_records(
    seed: int, num_tasks: int, tokenizer: Any, harness: HarnessConfig
) -> Iterator[dict[str, list[int]]]:
    """The SFT lines of the first `num_tasks` multifile training tasks of `seed`."""
    for position in range(num_tasks):
        yield from transcript(make_task("train", position, seed), tokenizer, harness).lines
