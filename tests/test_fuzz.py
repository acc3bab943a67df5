"""Fuzzing every method of every service, started as real processes: the reconciler, envs
and evals here; inference and the trainer from the shared deployment (its vLLM engine is
costly to start).

Request bodies come from ``tests.fuzz_support`` (strategies built from the proto
descriptors: extreme and unknown values, hostile strings, bodies that are not
messages). Every answer must be a deliberate status: never UNKNOWN or INTERNAL,
never DEADLINE_EXCEEDED where the method had no reason to wait, UNAUTHENTICATED for
every call without the token. Health stays SERVING throughout, nothing is logged at
ERROR, and afterwards the run still works (a claim/complete/pull/commit cycle).

The default profile is short and deterministic (part of ``make test``); set
``ETUDE_FUZZ=long`` for a long random run (2,000 bodies a method; ``ETUDE_FUZZ_EXAMPLES``
sets the number), and ``ETUDE_FUZZ_REPORT=<file>`` to have the figures (methods, calls,
statuses) written as JSON lines.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings

from services.api.v1 import (
    common_pb2,
    envs_pb2,
    envs_pb2_grpc,
    evals_pb2,
    inference_pb2,
    reconciler_pb2,
    trainer_pb2,
)
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel
from services.wire.ports import free_ports
from tests.conftest import REPO, TOKEN, Deployment, service_env, stop_process, wait_ready
from tests.fuzz_support import request_bodies
from tests.reconciler_support import ReconcilerProcess, reconciler
from tests.test_reconciler_store import rollout, task

pytestmark = pytest.mark.integration

PROFILE = os.environ.get("ETUDE_FUZZ", "short")
EXAMPLES = int(os.environ.get("ETUDE_FUZZ_EXAMPLES", {"short": 40, "long": 2000}[PROFILE]))
AUTH = (("authorization", f"Bearer {TOKEN}"),)
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
UNARY_TIMEOUT_S = 5.0
# How long an authenticated stream is read: a stream may rightly wait for work, so a
# deadline there is a fine answer. A call without the token gets UNARY_TIMEOUT_S however
# it streams: the refusal must come at once, and on two busy cores (two pytest-xdist
# workers beside a vLLM engine) it once took longer than this short read.
STREAM_READ_S = 0.3
# Every this many calls, one goes without the token.
UNAUTHENTICATED_EVERY = 7


@dataclass
class Tally:
    """What the fuzzer sent and what came back."""

    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    by_method: dict[str, collections.Counter[str]] = field(default_factory=dict)
    calls: int = 0

    def add(self, method: str, code: grpc.StatusCode) -> None:
        self.calls += 1
        self.statuses[code.name] += 1
        self.by_method.setdefault(method, collections.Counter())[code.name] += 1


def _may_wait(method: MethodDescriptor, body: bytes) -> bool:
    """Whether the request asks the server to wait (then a deadline is a fine answer)."""
    if method.server_streaming:
        return True
    try:
        request = message_factory.GetMessageClass(method.input_type).FromString(body)
    except Exception:  # not a message: the server must refuse it at once
        return False
    if isinstance(request, reconciler_pb2.PullBatchRequest):
        return request.wait_s > 0
    if isinstance(request, evals_pb2.RunEvalRequest):
        return request.wait
    return False


def _call(
    channel: grpc.Channel, path: str, method: MethodDescriptor, body: bytes, token: bool
) -> grpc.StatusCode:
    metadata = AUTH if token else ()
    try:
        if method.server_streaming:
            timeout = STREAM_READ_S if token else UNARY_TIMEOUT_S
            stream = channel.unary_stream(path)(body, metadata=metadata, timeout=timeout)
            with contextlib.suppress(StopIteration):
                next(stream)
            stream.cancel()
        else:
            channel.unary_unary(path)(body, metadata=metadata, timeout=UNARY_TIMEOUT_S)
    except grpc.RpcError as error:
        code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
        return grpc.StatusCode.OK if code == grpc.StatusCode.CANCELLED else code
    return grpc.StatusCode.OK


def _readiness(channel: grpc.Channel) -> int:
    answer = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="readiness"), timeout=5
    )
    return int(answer.status)


def _unchanged(body: bytes) -> bytes:
    return body


def _fuzz_method(
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    tally: Tally,
    rewrite: Callable[[bytes], bytes] = _unchanged,
) -> None:
    """Sends EXAMPLES drawn bodies (each through `rewrite`) to one method."""
    path = f"/{service.full_name}/{method.name}"

    @settings(
        max_examples=EXAMPLES,
        derandomize=PROFILE == "short",
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(request_bodies(method.input_type))
    def send(body: bytes) -> None:
        body = rewrite(body)
        token = (tally.calls + 1) % UNAUTHENTICATED_EVERY != 0
        code = _call(channel, path, method, body, token)
        tally.add(f"{service.name}.{method.name}", code)
        if not token:
            assert code == grpc.StatusCode.UNAUTHENTICATED, (path, body[:200], code)
        assert code not in NEVER, (path, body[:200], code)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            assert _may_wait(method, body), (path, body[:200], code)

    send()


def fuzz(target: str, service: ServiceDescriptor, tally: Tally) -> None:
    """Sends EXAMPLES drawn bodies to every method of `service` at `target`; readiness
    must stay SERVING after each method."""
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(target, options=options) as channel:
        for method in service.methods:
            _fuzz_method(channel, service, method, tally)
            status = _readiness(channel)
            assert status == health_pb2.HealthCheckResponse.SERVING, (method.name, status)


class _HealthOnly:
    """A stand-in for inference that only answers its health checks (evals waits for it)."""

    def __init__(self, port: int) -> None:
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")

    def __enter__(self) -> _HealthOnly:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


@dataclass
class Targets:
    reconciler: ReconcilerProcess
    # service name -> (target, log file)
    others: dict[str, tuple[str, Path]]


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    root = tmp_path_factory.mktemp("fuzz")
    run_name = f"fuzz-{uuid.uuid4().hex[:8]}"
    # The sandbox uid must reach the workspaces, which pytest's private tmp dirs are not.
    workspaces = Path(tempfile.mkdtemp(prefix="etude-fuzz-"))
    workspaces.chmod(0o755)
    inference_port, *ports = free_ports(5)
    with reconciler(root, run_name=run_name) as control, _HealthOnly(inference_port):
        config = root / "config.toml"
        lines = [
            f'[run]\nname = "{run_name}"\nstate_dir = "{root / "state"}"',
            f'[object_store]\nurl = "file://{root / "state" / "store"}"',
            f'[endpoints]\nreconciler = "{control.target}"',
            f'inference = "127.0.0.1:{inference_port}"',
            f'[envs]\nworkers = 0\nworkspaces_dir = "{workspaces}"',
            "[evals]\nwatch = false",
        ]
        names = ("envs", "evals")
        for index, name in enumerate(names):
            grpc_port, http_port = ports[2 * index], ports[2 * index + 1]
            lines += [
                f'[{name}.grpc]\nhost = "127.0.0.1"\nport = {grpc_port}\nshutdown_grace_s = 2',
                f'[{name}.http]\nhost = "127.0.0.1"\nport = {http_port}',
            ]
        config.write_text("\n".join(lines) + "\n")
        processes: dict[str, subprocess.Popen[bytes]] = {}
        others: dict[str, tuple[str, Path]] = {}
        try:
            for index, name in enumerate(names):
                log_path = root / f"{name}.log"
                with log_path.open("wb") as log:
                    processes[name] = subprocess.Popen(
                        [sys.executable, "-m", f"services.{name}", "--config", str(config)],
                        cwd=REPO,
                        env={
                            **service_env(TOKEN),
                            f"ETUDE_{name.upper()}__READINESS_INTERVAL_S": "0.5",
                        },
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                others[name] = (f"127.0.0.1:{ports[2 * index]}", log_path)
            for name, process in processes.items():
                wait_ready(others[name][0], 60, process, others[name][1])
            yield Targets(control, others)
        finally:
            for process in processes.values():
                stop_process(process)
            shutil.rmtree(workspaces, ignore_errors=True)


def _report(name: str, tally: Tally) -> None:
    figures = {
        "service": name,
        "profile": PROFILE,
        "methods": len(tally.by_method),
        "calls": tally.calls,
        "statuses": dict(tally.statuses),
        "by_method": {m: dict(c) for m, c in sorted(tally.by_method.items())},
    }
    print(json.dumps(figures))
    if path := os.environ.get("ETUDE_FUZZ_REPORT"):
        with open(path, "a") as out:
            out.write(json.dumps(figures) + "\n")


async def _normal_cycle(target: str) -> None:
    """Submit, claim, complete, pull and commit one group, as a run does."""
    async with make_channel(target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        spec = reconciler_pb2.GroupSpec(
            task=task("after-fuzz"), num_samples=1, kind=common_pb2.SLOT_KIND_TRAIN, priority=1000
        )
        (future,) = await client.submit_many([spec])
        mine = None
        async with asyncio.timeout(30):
            while mine is None:  # slots the fuzzer made that are claimable go first: fail them
                for claimed in await client.claim("after-fuzz", 256):
                    if claimed.lease.group_id == future.group_id:
                        mine = claimed
                        continue
                    async with client.lease(claimed) as lease:
                        await lease.fail("drained after fuzzing", retryable=False)
        async with client.lease(mine) as lease:
            assert (await lease.complete(rollout(mine.lease.slot_id))).group_ready
        status = await client.stub.GetStatus(common_pb2.StatusRequest())
        version = status.current_policy_version
        # Groups the fuzzer's completions made ready come first: train them too, one a step.
        consumer, pulled = f"after-fuzz-{uuid.uuid4().hex[:8]}", []
        async with asyncio.timeout(60):
            while future.group_id not in pulled:
                step = len(pulled) + 1
                batch = await client.pull_batch(consumer, step, 1, current_version=version)
                assert len(batch.groups) == 1, batch
                pulled.append(batch.groups[0].group_id)
                assert await client.commit(consumer, step) == 1


def _fuzz_every_method(target: str, service: ServiceDescriptor) -> None:
    """Fuzzes every method of ``service`` at ``target``, reports the figures, and checks
    that every method was called and none answered UNKNOWN/INTERNAL (``NEVER``)."""
    tally = Tally()
    fuzz(target, service, tally)
    _report(service.name, tally)
    assert len(tally.by_method) == len(service.methods)
    assert not NEVER & {grpc.StatusCode[name] for name in tally.statuses}


def _assert_no_errors(log: str) -> None:
    assert " ERROR " not in log and "Traceback" not in log, log[-4000:]


def test_fuzz_reconciler(targets: Targets) -> None:
    service = reconciler_pb2.DESCRIPTOR.services_by_name["ReconcilerService"]
    _fuzz_every_method(targets.reconciler.target, service)
    asyncio.run(_normal_cycle(targets.reconciler.target))
    log = targets.reconciler.log()
    _assert_no_errors(log)


# The methods that act on a lease, and the request field that holds the leases ("": the
# request itself).
LEASED = {"HeartbeatSlot": "", "HeartbeatSlots": "leases", "CompleteSlot": "", "FailSlot": ""}
# Every other drawn body is merged into one of these (its set fields win), so that the
# fields a drawn body leaves unset do not stop it at validation before the slot.
VALID_BASES = {
    "CompleteSlot": reconciler_pb2.CompleteSlotRequest(
        rollout=common_pb2.RolloutSummary(
            rollout_id="r-fuzz",
            record=common_pb2.ObjectRef(key="rollouts/fuzz/r.pb", sha256="0" * 64),
        )
    ),
    "FailSlot": reconciler_pb2.FailSlotRequest(reason="fuzz"),
}


async def _claim_leases(target: str, count: int) -> list[reconciler_pb2.Lease]:
    """`count` live leases of fresh one-slot groups."""
    async with make_channel(target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        specs = [
            reconciler_pb2.GroupSpec(
                task=task(f"leased-{index}"),
                num_samples=1,
                kind=common_pb2.SLOT_KIND_TRAIN,
                priority=1000,
            )
            for index in range(count)
        ]
        wanted = {future.group_id for future in await client.submit_many(specs)}
        leases: list[reconciler_pb2.Lease] = []
        async with asyncio.timeout(30):
            while len(leases) < count:
                for claimed in await client.claim("fuzz-leases", 256, lease_ttl_s=600):
                    if claimed.lease.group_id in wanted:
                        leases.append(claimed.lease)
                        continue
                    async with client.lease(claimed) as lease:  # one the fuzzer submitted
                        await lease.fail("drained before fuzzing", retryable=False)
        return leases


def _lease_rewriter(
    method: MethodDescriptor, leases: list[reconciler_pb2.Lease]
) -> Callable[[bytes], bytes]:
    """Puts live leases (slot id and token) into drawn bodies that parse, so their other
    fields reach the state behind a valid lease; bodies that do not parse stay as drawn."""
    request_type = message_factory.GetMessageClass(method.input_type)
    calls, turn = iter(range(1 << 62)), iter(range(1 << 62))

    def rewrite(body: bytes) -> bytes:
        try:
            drawn = request_type.FromString(body)
        except Exception:  # not a message: sent as it is
            return body
        request = request_type()
        if method.name in VALID_BASES and next(calls) % 2:
            request.CopyFrom(VALID_BASES[method.name])
        request.MergeFrom(drawn)
        entries = getattr(request, LEASED[method.name]) if LEASED[method.name] else [request]
        if not entries:
            entries = [entries.add()]
        for entry in entries:
            lease = leases[next(turn) % len(leases)]
            entry.slot_id, entry.lease_token = lease.slot_id, lease.lease_token
        return request.SerializeToString()

    return rewrite


def test_fuzz_reconciler_behind_valid_leases(targets: Targets) -> None:
    """Bodies for the leased methods carry live leases: validation passes on the lease and
    the drawn rollouts, reasons and heartbeats reach the slots themselves."""
    target = targets.reconciler.target
    service = reconciler_pb2.DESCRIPTOR.services_by_name["ReconcilerService"]
    tally = Tally()
    with grpc.insecure_channel(target) as channel:
        for name in LEASED:
            method = service.methods_by_name[name]
            leases = asyncio.run(_claim_leases(target, EXAMPLES))
            _fuzz_method(channel, service, method, tally, _lease_rewriter(method, leases))
            assert _readiness(channel) == health_pb2.HealthCheckResponse.SERVING, name
    _report("ReconcilerService (live leases)", tally)
    assert not NEVER & {grpc.StatusCode[name] for name in tally.statuses}
    # Behind the lease: completions and failures the state machine took.
    assert tally.by_method["ReconcilerService.CompleteSlot"]["OK"] > 0, tally.by_method
    assert tally.by_method["ReconcilerService.FailSlot"]["OK"] > 0, tally.by_method
    asyncio.run(_normal_cycle(target))
    _assert_no_errors(targets.reconciler.log())


def test_fuzz_envs(targets: Targets) -> None:
    service = envs_pb2.DESCRIPTOR.services_by_name["EnvService"]
    target, log_path = targets.others["envs"]
    _fuzz_every_method(target, service)
    with grpc.insecure_channel(target) as channel:
        stub = envs_pb2_grpc.EnvServiceStub(channel)
        created = stub.CreateWorkspace(
            envs_pb2.CreateWorkspaceRequest(task=task("after-fuzz")), metadata=AUTH, timeout=30
        )
        ran = stub.Exec(
            envs_pb2.ExecRequest(workspace_id=created.workspace_id, argv=["true"]),
            metadata=AUTH,
            timeout=30,
        )
        assert ran.result.exit_code == 0, ran.result
    log = log_path.read_text(errors="replace")
    _assert_no_errors(log)


def test_fuzz_evals(targets: Targets) -> None:
    service = evals_pb2.DESCRIPTOR.services_by_name["EvalsService"]
    target, evals_log = targets.others["evals"]
    _fuzz_every_method(target, service)
    with grpc.insecure_channel(target) as channel:
        suites = channel.unary_unary(
            f"/{service.full_name}/ListSuites",
            request_serializer=evals_pb2.ListSuitesRequest.SerializeToString,
            response_deserializer=evals_pb2.ListSuitesResponse.FromString,
        )(evals_pb2.ListSuitesRequest(), metadata=AUTH, timeout=5)
        assert len(suites.suites) > 0
    log = evals_log.read_text(errors="replace")
    _assert_no_errors(log)


@pytest.mark.parametrize(
    ("name", "service"),
    [
        ("inference", inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]),
        ("trainer", trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]),
    ],
)
def test_fuzz_deployment(deployment: Deployment, name: str, service: ServiceDescriptor) -> None:
    """Inference and the trainer of the shared deployment (a vLLM engine is costly to start)."""
    log_path = deployment.logs[name]
    start = log_path.stat().st_size
    _fuzz_every_method(deployment.target(name), service)
    with log_path.open("rb") as log:
        log.seek(start)
        written = log.read().decode(errors="replace")
    _assert_no_errors(written)
