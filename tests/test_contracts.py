"""proto/ is the contract: stubs are current and every service implements every method."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from services.api.v1 import (
    envs_pb2,
    envs_pb2_grpc,
    evals_pb2,
    evals_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    reconciler_pb2,
    reconciler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.envs.service import EnvServicer
from services.evals.service import EvalsServicer
from services.inference.service import InferenceServicer
from services.reconciler.service import ReconcilerServicer
from services.trainer.service import TrainerServicer
from tests.conftest import REPO

SERVICERS = [
    (
        reconciler_pb2,
        "ReconcilerService",
        reconciler_pb2_grpc.ReconcilerServiceServicer,
        ReconcilerServicer,
    ),
    (envs_pb2, "EnvService", envs_pb2_grpc.EnvServiceServicer, EnvServicer),
    (
        inference_pb2,
        "InferenceService",
        inference_pb2_grpc.InferenceServiceServicer,
        InferenceServicer,
    ),
    (trainer_pb2, "TrainerService", trainer_pb2_grpc.TrainerServiceServicer, TrainerServicer),
    (evals_pb2, "EvalsService", evals_pb2_grpc.EvalsServiceServicer, EvalsServicer),
]


def test_generated_stubs_match_proto() -> None:
    done = subprocess.run(
        [sys.executable, "tools/protogen.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("module", "name", "base", "servicer"), SERVICERS, ids=[s[1] for s in SERVICERS]
)
def test_every_method_is_overridden_and_async(module, name, base, servicer) -> None:  # type: ignore[no-untyped-def]
    methods = [m.name for m in module.DESCRIPTOR.services_by_name[name].methods]
    assert methods
    for method in methods:
        implementation = getattr(servicer, method)
        assert implementation is not getattr(base, method), (
            f"{name}.{method} falls back to the stub"
        )
        assert inspect.iscoroutinefunction(implementation) or inspect.isasyncgenfunction(
            implementation
        )
    assert "GetStatus" in methods


def test_every_service_has_a_status_with_service_info() -> None:
    for module, name, _, _ in SERVICERS:
        status = module.DESCRIPTOR.services_by_name[name].methods_by_name["GetStatus"]
        assert (
            status.output_type.fields_by_name["info"].message_type.full_name
            == "etude.v1.ServiceInfo"
        )
