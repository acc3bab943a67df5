"""Every service as a real process: health, reflection, metrics, auth, validation,
tracing across services, and inference parity with transformers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.api.v1 import (
    common_pb2,
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
from services.config import SERVICE_NAMES
from services.wire.client import make_channel
from tests.conftest import (
    REPO,
    TOKEN,
    Deployment,
    service_env,
    stop_process,
    wait_ready,
    write_config,
)

pytestmark = pytest.mark.integration

AUTH = (("authorization", f"Bearer {TOKEN}"),)

FULL_NAMES = {
    "reconciler": "etude.v1.ReconcilerService",
    "envs": "etude.v1.EnvService",
    "inference": "etude.v1.InferenceService",
    "trainer": "etude.v1.TrainerService",
    "evals": "etude.v1.EvalsService",
}

STUBS: dict[str, Any] = {
    "reconciler": reconciler_pb2_grpc.ReconcilerServiceStub,
    "envs": envs_pb2_grpc.EnvServiceStub,
    "inference": inference_pb2_grpc.InferenceServiceStub,
    "trainer": trainer_pb2_grpc.TrainerServiceStub,
    "evals": evals_pb2_grpc.EvalsServiceStub,
}


def _valid_task() -> common_pb2.Task:
    return common_pb2.Task(
        task_id="synthetic/train/0",
        family="synthetic",
        grading=common_pb2.GradingSpec(command=["python", "-m", "pytest"]),
    )


# One malformed request per service, and the field its error must name.
MALFORMED: dict[str, tuple[str, Any, str]] = {
    "reconciler": (
        "SubmitGroups",
        reconciler_pb2.SubmitGroupsRequest(
            groups=[reconciler_pb2.GroupSpec(task=_valid_task(), num_samples=0, kind=1)]
        ),
        "groups[0].num_samples",
    ),
    "envs": ("Exec", envs_pb2.ExecRequest(workspace_id="ws-1", argv=[]), "argv"),
    "inference": (
        "Generate",
        inference_pb2.GenerateRequest(
            prompt_token_ids=[], sampling=inference_pb2.SamplingParams(max_tokens=4)
        ),
        "prompt_token_ids",
    ),
    # A tag that ends in a newline: a '^...$' pattern let it through to the job.
    "trainer": ("SaveCheckpoint", trainer_pb2.SaveCheckpointRequest(tag="step-1\n"), "tag"),
    "evals": ("RunEval", evals_pb2.RunEvalRequest(suite=""), "suite"),
}


def _call(stub: Any, method: str, request: Any, metadata: Any = AUTH) -> Any:
    """Calls a unary or server-streaming method and returns the (last) response."""
    answer = getattr(stub, method)(request, metadata=metadata, timeout=30)
    if hasattr(answer, "__iter__") and not hasattr(answer, "SerializeToString"):
        return list(answer)
    return answer


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_health_liveness_and_readiness(deployment: Deployment, service: str) -> None:
    with grpc.insecure_channel(deployment.target(service)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "liveness", "readiness", FULL_NAMES[service]):
            answer = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_reflection_lists_the_service(deployment: Deployment, service: str) -> None:
    with grpc.insecure_channel(deployment.target(service)) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        listed = set(database.get_services())
        assert {FULL_NAMES[service], "grpc.health.v1.Health"} <= listed
        methods = database.FindFileContainingSymbol(FULL_NAMES[service]).service[0].method
        assert "GetStatus" in {m.name for m in methods}


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_http_side_metrics_and_probes(deployment: Deployment, service: str) -> None:
    with grpc.insecure_channel(deployment.target(service)) as channel:
        _call(STUBS[service](channel), "GetStatus", common_pb2.StatusRequest())
    with urllib.request.urlopen(f"{deployment.http(service)}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert f'etude_service_ready{{service="{service}"}} 1.0' in metrics
    handled = [
        line
        for line in metrics.splitlines()
        if line.startswith("grpc_server_handled_total")
        and 'grpc_method="GetStatus"' in line
        and 'grpc_code="OK"' in line
    ]
    assert handled and float(handled[0].split()[-1]) >= 1
    assert "grpc_server_handling_seconds_bucket" in metrics
    for path, expected in (("/healthz", {"live": True}), ("/readyz", None)):
        with urllib.request.urlopen(f"{deployment.http(service)}{path}", timeout=5) as response:
            body = json.load(response)
        assert response.status == 200
        if expected is not None:
            assert body == expected
        else:
            assert body["ready"] is True
    with urllib.request.urlopen(f"{deployment.http(service)}/", timeout=5) as response:
        assert f"etude {service}" in response.read().decode()


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_calls_without_the_token_are_unauthenticated(deployment: Deployment, service: str) -> None:
    with grpc.insecure_channel(deployment.target(service)) as channel:
        stub = STUBS[service](channel)
        for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as denied:
                _call(stub, "GetStatus", common_pb2.StatusRequest(), metadata)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A malformed request from a stranger is still refused for the token, not parsed.
        method, request, _ = MALFORMED[service]
        with pytest.raises(grpc.RpcError) as denied:
            _call(stub, method, request, None)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = _call(stub, "GetStatus", common_pb2.StatusRequest()).info
        assert (info.service, info.ready) == (service, True)


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_malformed_request_names_the_field(deployment: Deployment, service: str) -> None:
    method, request, field = MALFORMED[service]
    with (
        grpc.insecure_channel(deployment.target(service)) as channel,
        pytest.raises(grpc.RpcError) as rejected,
    ):
        _call(STUBS[service](channel), method, request)
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rejected.value.details().startswith(f"{field}: "), rejected.value.details()
    # The service is unharmed.
    with grpc.insecure_channel(deployment.target(service)) as channel:
        assert _call(STUBS[service](channel), "GetStatus", common_pb2.StatusRequest()).info.ready


def test_evals_lists_its_suites(deployment: Deployment) -> None:
    """The deployed evals service knows the two built-in suites and their sizes."""
    with grpc.insecure_channel(deployment.target("evals")) as channel:
        stub = evals_pb2_grpc.EvalsServiceStub(channel)
        answer = stub.ListSuites(evals_pb2.ListSuitesRequest(), metadata=AUTH, timeout=30)
    suites = {(s.name, s.family): s.num_tasks for s in answer.suites}
    assert suites[("humaneval", "humaneval")] == 164
    assert suites[("synthetic-heldout", "synthetic")] > 0


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_trace_continues_across_services(deployment: Deployment) -> None:
    """Test client -> evals GetStatus -> evals probes reconciler and inference: one trace."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def call() -> evals_pb2.EvalsStatusResponse:
        async with make_channel(
            deployment.target("evals"), token=TOKEN, tracer_provider=provider
        ) as channel:
            stub = evals_pb2_grpc.EvalsServiceStub(channel)
            return await stub.GetStatus(common_pb2.StatusRequest(include_dependencies=True))

    with tracer.start_as_current_span("test-root") as root:
        status = asyncio.run(call())
    trace_id = f"{root.get_span_context().trace_id:032x}"
    assert {d.name: d.ready for d in status.info.dependencies} == {
        "reconciler": True,
        "inference": True,
    }
    client_span = next(s for s in exporter.get_finished_spans() if s.name.endswith("GetStatus"))
    client_span_id = f"{client_span.get_span_context().span_id:016x}"

    deadline = time.monotonic() + 10
    while True:
        evals = [
            s for s in _spans(deployment.traces_dir / "evals.jsonl") if s["trace_id"] == trace_id
        ]
        downstream = {
            name: [
                s
                for s in _spans(deployment.traces_dir / f"{name}.jsonl")
                if s["trace_id"] == trace_id
            ]
            for name in ("reconciler", "inference")
        }
        if (evals and all(downstream.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    server = next(s for s in evals if s["kind"] == "SERVER")
    assert server["parent_span_id"] == client_span_id
    evals_clients = {s["span_id"]: s for s in evals if s["kind"] == "CLIENT"}
    for name, spans in downstream.items():
        assert spans, f"no span of trace {trace_id} in {name}"
        (health_span,) = spans
        assert health_span["kind"] == "SERVER" and health_span["name"].endswith("Health/Check")
        parent = evals_clients[health_span["parent_span_id"]]
        assert parent["parent_span_id"] == server["span_id"]


def test_inference_matches_transformers(deployment: Deployment, tiny_model: Path) -> None:
    """vLLM (CPU) sampling from the factory's tiny model, scored again by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tokenizer.encode("def add(a, b):\n    return")
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=inference_pb2.SamplingParams(
            temperature=1.0, max_tokens=24, seed=7, ignore_eos=True
        ),
    )
    with grpc.insecure_channel(deployment.target("inference")) as channel:
        chunks = list(
            inference_pb2_grpc.InferenceServiceStub(channel).Generate(
                request, metadata=AUTH, timeout=60
            )
        )
    tokens = [t for c in chunks for t in c.token_ids]
    vllm_logprobs = torch.tensor([lp for c in chunks for lp in c.logprobs])
    assert len(tokens) == 24 and chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert [c.offset for c in chunks] == [
        sum(len(p.token_ids) for p in chunks[:i]) for i in range(len(chunks))
    ]
    assert [(s.version, s.start, s.end) for s in chunks[-1].version_spans] == [(0, 0, 24)]

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits.float()
    logprobs = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    reference = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    difference = (reference - vllm_logprobs).abs()
    # bf16 weights and activations, different kernels: agreement to bf16 resolution.
    assert difference.max().item() < 0.05, difference
    assert difference.mean().item() < 0.01, difference


def test_sigterm_shuts_a_service_down_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    ports = write_config(tmp_path / "config.toml", model_dir=tiny_model, state_dir=tmp_path)
    log = tmp_path / "trainer.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.reconciler",
                "--config",
                str(tmp_path / "config.toml"),
            ],
            cwd=REPO,
            env=service_env(TOKEN),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_ready(f"127.0.0.1:{ports['reconciler'][0]}", 60, process, log)
    finally:
        code = stop_process(process, timeout_s=20)
    assert code == 0, log.read_text()
    assert "reconciler stopped" in log.read_text()
