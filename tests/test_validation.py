"""Request validators: each failure names the field a caller can fix."""

from __future__ import annotations

import pytest

from services.api.v1 import common_pb2, envs_pb2, inference_pb2, reconciler_pb2
from services.envs import validation as envs_validation
from services.inference.validation import validate_generate
from services.messages import validate_task
from services.reconciler import validation as reconciler_validation
from services.wire.errors import InvalidArgument


def _task(**overrides: object) -> common_pb2.Task:
    task = common_pb2.Task(
        task_id="t-1", family="synthetic", grading=common_pb2.GradingSpec(command=["pytest"])
    )
    for key, value in overrides.items():
        if key == "files":
            task.files.extend(value)  # type: ignore[arg-type]
        elif key == "metadata":
            task.metadata.update(value)  # type: ignore[call-overload]
        else:
            setattr(task, key, value)
    return task


@pytest.mark.parametrize(
    ("task", "field"),
    [
        (_task(task_id=""), "task.task_id"),
        (_task(task_id="has space"), "task.task_id"),
        (_task(family=""), "task.family"),
        (_task(files=[common_pb2.WorkspaceFile(path="../escape")]), "task.files[0].path"),
        (_task(files=[common_pb2.WorkspaceFile(path="/etc/passwd")]), "task.files[0].path"),
        (_task(difficulty=1.5), "task.difficulty"),
        (_task(instruction="write\x00it"), "task.instruction"),
        (_task(instruction="x" * (1024 * 1024 + 1)), "task.instruction"),
        (_task(split="s" * 65), "task.split"),
        (_task(metadata={"entry\x00": "f"}), r"task.metadata['entry\x00']"),
        (_task(metadata={"entry": "v" * (64 * 1024 + 1)}), "task.metadata['entry']"),
        (_task(metadata={"": "v"}), "task.metadata['']"),
        (_task(metadata={f"k{i}": "" for i in range(257)}), "task.metadata"),
        (
            _task(files=[common_pb2.WorkspaceFile(path="big", content=bytes(16 * 2**20 + 1))]),
            "task.files[0].content",
        ),
        (
            _task(
                files=[
                    common_pb2.WorkspaceFile(path=f"f{i}", content=bytes(11 * 2**20))
                    for i in range(3)
                ]
            ),
            "task.files",
        ),
        (
            _task(files=[common_pb2.WorkspaceFile(path=f"f{i}") for i in range(4097)]),
            "task.files",
        ),
        (common_pb2.Task(task_id="t", family="f"), "task.grading.command"),
    ],
)
def test_task_problems_name_the_field(task: common_pb2.Task, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        validate_task(task, "task")
    assert error.value.field == field and str(error.value).startswith(f"{field}: ")


def test_valid_task_passes() -> None:
    validate_task(_task(files=[common_pb2.WorkspaceFile(path="src/a.py")]), "task")
    # At the limits, not past them.
    at_limits = _task(
        instruction="x" * 1024 * 1024,
        split="s" * 64,
        metadata={"k" * 256: "v" * 64 * 1024},
        files=[common_pb2.WorkspaceFile(path="big", content=bytes(16 * 2**20))],
    )
    validate_task(at_limits, "task")


def test_hidden_files_are_bounded_like_workspace_files() -> None:
    task = _task()
    task.grading.hidden_files.add(path="tests/t.py", content=bytes(16 * 2**20 + 1))
    with pytest.raises(InvalidArgument, match=r"^task\.grading\.hidden_files\[0\]\.content: "):
        validate_task(task, "task")


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (reconciler_pb2.SubmitGroupsRequest(), "groups"),
        (
            reconciler_pb2.SubmitGroupsRequest(
                groups=[reconciler_pb2.GroupSpec(task=_task(), num_samples=4)]
            ),
            "groups[0].kind",
        ),
        (
            reconciler_pb2.SubmitGroupsRequest(
                groups=[reconciler_pb2.GroupSpec(task=_task(), num_samples=2000, kind=1)]
            ),
            "groups[0].num_samples",
        ),
    ],
)
def test_submit_groups(request_: reconciler_pb2.SubmitGroupsRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        reconciler_validation.validate_submit_groups(request_)
    assert error.value.field == field


def test_complete_slot_bounds_the_summary_kept_in_redis() -> None:
    request = reconciler_pb2.CompleteSlotRequest(
        slot_id="0123456789abcdef/0",
        lease_token="t",
        rollout=common_pb2.RolloutSummary(
            rollout_id="r-1",
            record=common_pb2.ObjectRef(key="rollouts/r.pb", sha256="0" * 64),
            finish_reason="x" * 2**20,
        ),
    )
    with pytest.raises(InvalidArgument, match=r"^rollout: at most 1048576 bytes"):
        reconciler_validation.validate_complete_slot(request)
    request.rollout.finish_reason = "stop"
    reconciler_validation.validate_complete_slot(request)


def test_complete_slot_needs_a_record_with_a_checksum() -> None:
    request = reconciler_pb2.CompleteSlotRequest(
        slot_id="s-1",
        lease_token="tok",
        rollout=common_pb2.RolloutSummary(
            rollout_id="r-1", record=common_pb2.ObjectRef(key="k", sha256="abc")
        ),
    )
    with pytest.raises(InvalidArgument, match=r"^slot_id: "):
        reconciler_validation.validate_complete_slot(request)
    request.slot_id = "0123456789abcdef/3"
    with pytest.raises(InvalidArgument) as error:
        reconciler_validation.validate_complete_slot(request)
    assert error.value.field == "rollout.record.sha256"
    request.rollout.record.sha256 = "0" * 64
    reconciler_validation.validate_complete_slot(request)
    request.lease_token = ""
    with pytest.raises(InvalidArgument, match=r"^lease_token: "):
        reconciler_validation.validate_complete_slot(request)
    request.lease_token = "tok"
    request.rollout.rollout_id = ""
    with pytest.raises(InvalidArgument, match=r"^rollout\.rollout_id: "):
        reconciler_validation.validate_complete_slot(request)


def _generate(prompt: list[int], **sampling: object) -> inference_pb2.GenerateRequest:
    params = {"max_tokens": 8, **sampling}
    return inference_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=inference_pb2.SamplingParams(**params),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_generate([]), "prompt_token_ids"),
        (_generate([1, 2, 5000]), "prompt_token_ids"),
        (_generate([1], max_tokens=0), "sampling.max_tokens"),
        (_generate([1] * 100, max_tokens=30), "sampling.max_tokens"),
        (_generate([1], temperature=-1.0), "sampling.temperature"),
        (_generate([1], temperature=float("nan")), "sampling.temperature"),
        (_generate([1], top_p=1.5), "sampling.top_p"),
        (_generate([1], min_tokens=9), "sampling.min_tokens"),
        (_generate([1], top_p=float("nan")), "sampling.top_p"),
        (_generate([1], top_k=1025), "sampling.top_k"),
        (_generate([1], stop_token_ids=[4096]), "sampling.stop_token_ids[0]"),
        (_generate([1], stop_token_ids=[1] * 1025), "sampling.stop_token_ids"),
        (inference_pb2.GenerateRequest(prompt_token_ids=[1]), "sampling"),
    ],
)
def test_generate(request_: inference_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        validate_generate(request_, vocab_size=1024, max_model_len=128)
    assert error.value.field == field


def test_exec_and_fork() -> None:
    with pytest.raises(InvalidArgument, match=r"^timeout_s: "):
        envs_validation.validate_exec(
            envs_pb2.ExecRequest(workspace_id="w", argv=["ls"], timeout_s=1e9)
        )
    with pytest.raises(InvalidArgument, match=r"^env\['A=B'\]: "):
        envs_validation.validate_exec(
            envs_pb2.ExecRequest(workspace_id="w", argv=["ls"], env={"A=B": "1"})
        )
    with pytest.raises(InvalidArgument, match=r"^stdin: at most 16777216 bytes"):
        envs_validation.validate_exec(
            envs_pb2.ExecRequest(workspace_id="w", argv=["cat"], stdin=bytes(16 * 2**20 + 1))
        )
    with pytest.raises(InvalidArgument, match=r"^num_forks: "):
        envs_validation.validate_fork(envs_pb2.ForkWorkspaceRequest(source_id="w", num_forks=0))
    envs_validation.validate_exec(envs_pb2.ExecRequest(workspace_id="w", argv=["ls"], timeout_s=5))
