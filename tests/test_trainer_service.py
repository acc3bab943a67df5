"""The idle trainer's API as a real process, and the job settings' checks."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from services.api.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.config.deployment import EtudeConfig
from tests.conftest import TOKEN, stop_process
from tests.trainer_support import start_trainer, write_trainer_config

AUTH = (("authorization", f"Bearer {TOKEN}"),)


def test_an_idle_trainer_answers_status_and_has_nothing_to_checkpoint(tmp_path: Path) -> None:
    """`etude serve trainer` without a job: status "idle", no checkpoint to save or list."""
    grpc_port, _ = write_trainer_config(
        tmp_path / "idle.toml", run="idle", reconciler_target="127.0.0.1:1", root=tmp_path, job=None
    )
    process = start_trainer(tmp_path / "idle.toml", tmp_path / "idle.log")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            # Its reconciler is unreachable; the trainer answers anyway.
            status = stub.GetStatus(
                common_pb2.StatusRequest(), metadata=AUTH, timeout=60, wait_for_ready=True
            )
            with pytest.raises(grpc.RpcError) as refused:
                stub.SaveCheckpoint(
                    trainer_pb2.SaveCheckpointRequest(tag="now"), metadata=AUTH, timeout=10
                )
            listed = stub.ListCheckpoints(trainer_pb2.ListCheckpointsRequest(), metadata=AUTH)
    finally:
        assert stop_process(process) == 0, (tmp_path / "idle.log").read_text()
    assert status.phase == "idle" and status.step == 0 and status.info.service == "trainer"
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no training job" in refused.value.details()
    assert list(listed.checkpoints) == []


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ({"phase": "sft"}, "needs [trainer.job.data]"),
        ({"phase": "sft", "data": {"kind": "corpus"}}, "data.kind must be 'jsonl', got 'corpus'"),
        ({"phase": "cpt", "data": {"kind": "jsonl"}}, "needs data.path"),
        (
            {"phase": "cpt", "data": {"tokens_per_step": 64, "max_seq_len": 128}},
            "max_seq_len (128) must not exceed data.tokens_per_step (64)",
        ),
        ({"phase": "rl", "optimizer": {"betas": [0.9, 1.5]}}, "betas must each be in [0, 1)"),
        ({"phase": "rl", "rl": {"importance_cap": 0.5}}, "greater than or equal to 1"),
        ({"phase": "rl", "replay": {"mode": "sometimes"}}, "when_present"),
    ],
)
def test_job_settings_are_checked_and_errors_name_the_values(
    job: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError) as error:
        EtudeConfig.model_validate({"trainer": {"job": job}})
    assert message in str(error.value)
