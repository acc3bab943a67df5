"""A scripted policy for eval tests: a real gRPC InferenceService that answers every
rollout with a known-right, wrong or broken solution, and the rollout workers that use it.

The stand-in replaces the model only. It recognises the task by the instruction's token
ids in the prompt (the harness tokenizes it as one piece) and answers, in the harness's
tool-call grammar and the tiny model's tokens, ``write_file`` of the solution and then
``finish``: a one-turn rollout. Which answer comes is scripted per (serving version,
task): the n-th request gets the n-th outcome of the plan, so a task with plan
``["right", "wrong"]`` has exactly one correct sample of two, whatever order the
workers run in. The reconciler, the envs rollout worker, the sandbox and the grader
are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.api.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.config.envs import HarnessConfig, RewardConfig, SandboxConfig
from services.envs.grading import grade
from services.envs.sandbox import make_sandbox
from services.envs.worker import RolloutWorker
from services.envs.workspace import Workspaces
from services.families import file_of, load_family
from services.model_factory.vocabulary import special_token_ids
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel
from services.wire.ports import free_port
from tests.conftest import TOKEN

Outcome = Literal["right", "wrong", "broken"]
# {serving version: {task id: outcome of the 1st, 2nd, ... request}}
Plan = dict[int, dict[str, Sequence[Outcome]]]

SPECIAL = special_token_ids()
# Room for HumanEval's longest canonical write_file call in one turn.
HARNESS = HarnessConfig(
    max_turns=2, max_tokens_per_turn=2048, max_total_tokens=4096, context_tokens=8192
)


def solution(task: common_pb2.Task, outcome: Outcome) -> common_pb2.WorkspaceFile:
    """The file a scripted sample writes: the canonical solution, one that returns None,
    or one that does not parse."""
    family = load_family(task.family)
    if outcome == "right":
        completion = family.canonical_completion(task)
        assert completion is not None, task.task_id
    elif outcome == "wrong" and task.family == "synthetic":
        completion = file_of(task, "solution.py").replace("    pass\n", "    return None\n")
    elif outcome == "wrong":
        completion = "    return None\n"
    else:
        completion = "def broken(:\n"
    (file,) = family.solution_files(task, completion)
    return file


def count_correct(plan: Sequence[Outcome]) -> int:
    return sum(outcome == "right" for outcome in plan)


class ScriptedInference(inference_pb2_grpc.InferenceServiceServicer):
    """InferenceService.Generate answering each task as the plan says."""

    def __init__(self, tokenizer: Any, tasks: Sequence[common_pb2.Task], plan: Plan) -> None:
        self.tokenizer = tokenizer
        self.plan = plan
        self.serving_version = 0
        self.requests: Counter[tuple[int, str]] = Counter()
        self.unplanned = 0
        self._tasks = {self._encode(t.instruction): t for t in tasks}

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(
            self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        )

    def _task(self, prompt: list[int]) -> common_pb2.Task:
        start = prompt.index(SPECIAL["<|user|>"]) + 1
        end = prompt.index(SPECIAL["<|end_of_turn|>"], start)
        return self._tasks[tuple(prompt[start:end])]

    def _call(self, name: str, arguments: dict[str, str]) -> list[int]:
        payload = json.dumps({"name": name, "arguments": arguments})
        return [SPECIAL["<|tool_call|>"], *self._encode(payload), SPECIAL["<|/tool_call|>"]]

    def answer(self, prompt: list[int]) -> list[int]:
        """The token ids of the next scripted sample for the prompt's task."""
        task = self._task(prompt)
        version = self.serving_version
        index = self.requests[(version, task.task_id)]
        self.requests[(version, task.task_id)] += 1
        outcomes = self.plan.get(version, {}).get(task.task_id, ())
        if index >= len(outcomes):
            self.unplanned += 1
        outcome = outcomes[index] if index < len(outcomes) else "wrong"
        file = solution(task, outcome)
        return [
            *self._call("write_file", {"path": file.path, "content": file.content.decode()}),
            *self._call("finish", {"message": "done"}),
            SPECIAL["<|end_of_turn|>"],
        ]

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        ids = self.answer(list(request.prompt_token_ids))
        assert len(ids) <= request.sampling.max_tokens, "raise HARNESS.max_tokens_per_turn"
        yield inference_pb2.GenerateResponse(
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            version_spans=[
                common_pb2.VersionSpan(version=self.serving_version, start=0, end=len(ids))
            ],
            finish_reason=inference_pb2.FINISH_REASON_STOP,
            num_prompt_tokens=len(request.prompt_token_ids),
        )


class ScriptedStack:
    """The stand-in inference server and rollout workers, on an event loop of their own
    (a thread), claiming from a real reconciler and storing records in `store_dir`."""

    def __init__(
        self,
        *,
        reconciler_target: str,
        store_dir: Path,
        run_name: str,
        tokenizer: Any,
        tasks: Sequence[common_pb2.Task],
        plan: Plan,
        concurrency: int = 3,
    ) -> None:
        self.inference = ScriptedInference(tokenizer, tasks, plan)
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._reconciler_target = reconciler_target
        self._store = FileObjectStore(store_dir)
        self._run_name = run_name
        self._tokenizer = tokenizer
        self._concurrency = concurrency
        self._root = Path(tempfile.mkdtemp(prefix="etude-evals-ws-", dir="/tmp"))
        self._root.chmod(0o755)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="scripted-stack", daemon=True)

    def __enter__(self) -> ScriptedStack:
        self._thread.start()
        if not self._ready.wait(60) or self._failure is not None:
            raise AssertionError(f"the scripted stack did not start: {self._failure!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        for directory, _, _ in os.walk(self._root):
            os.chmod(directory, 0o755)
        shutil.rmtree(self._root, ignore_errors=True)

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:
            self._failure = error
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.inference, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for name in ("", "liveness", "readiness"):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        server.add_insecure_port(self.target)
        await server.start()
        async with (
            make_channel(self._reconciler_target, token=TOKEN) as control,
            make_channel(self.target, token=TOKEN) as inference,
        ):
            worker = RolloutWorker(
                worker_id="scripted-worker",
                reconciler=ReconcilerClient(control),
                inference=inference,
                workspaces=Workspaces(self._root, make_sandbox(SandboxConfig(wall_s=20))),
                store=self._store,
                tokenizer=self._tokenizer,
                grade=grade,
                run_name=self._run_name,
                harness=HARNESS,
                rewards=RewardConfig(),
                lease_ttl_s=60,
            )
            running = asyncio.create_task(worker.run(self._concurrency, idle_s=0.1))
            self._ready.set()
            await self._stop.wait()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        await server.stop(1)
