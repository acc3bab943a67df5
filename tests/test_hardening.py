"""Hostile and malformed input never breaks a run (issue 33): one test per finding.

The reconciler runs as a real process (a fresh one and a fresh run per test); the
envs service runs in process with its real sandbox, since its checks come before any
dependency is asked.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.v1 import common_pb2, envs_pb2, envs_pb2_grpc, reconciler_pb2
from services.config.deployment import load_config
from services.envs.service import EnvsService
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.trainer.rollouts import RolloutError, fetch_record
from services.wire.client import make_channel
from services.wire.errors import InvalidArgument, require_identifier
from services.wire.ports import free_port
from services.wire.server import build_server, make_service
from tests.conftest import TOKEN
from tests.reconciler_support import ReconcilerProcess, reconciler
from tests.test_reconciler_store import rollout, spec

pytestmark = pytest.mark.integration

MAX_EXACT = 2**53 - 1
RECONCILER = "/etude.v1.ReconcilerService/"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ReconcilerProcess]:
    with reconciler(tmp_path, extra="lease_ttl_s = 5") as process:
        yield process


@pytest.fixture
async def client(server: ReconcilerProcess) -> AsyncIterator[ReconcilerClient]:
    async with make_channel(server.target, token=TOKEN) as channel:
        yield ReconcilerClient(channel)


async def _refused(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as error:
        await call  # type: ignore[misc]
    return error.value.code(), error.value.details()


async def test_huge_versions_and_steps_are_refused_and_kept_exact(
    client: ReconcilerClient,
) -> None:
    """Finding 1: a version past 2^53-1 used to poison the run (stored as "1e+17")."""
    stub = client.stub

    def publish(version: int) -> object:
        notice = common_pb2.PolicyVersionNotice(version=version, manifest_key=f"w/v{version}.json")
        return stub.PublishPolicyVersion(reconciler_pb2.PublishPolicyVersionRequest(notice=notice))

    for version in (10**17, 2**64 - 1, 2**53 + 1):
        code, details = await _refused(publish(version))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith("notice.version: "), details
    (gid,) = [f.group_id for f in await client.submit_many([spec(k=1)])]
    status = await stub.GetStatus(common_pb2.StatusRequest())
    assert status.current_policy_version == 0
    answer = await publish(MAX_EXACT)
    assert answer.current_policy_version == MAX_EXACT  # type: ignore[attr-defined]
    status = await stub.GetStatus(common_pb2.StatusRequest())
    assert status.current_policy_version == MAX_EXACT
    watch = stub.WatchPolicyVersions(reconciler_pb2.WatchPolicyVersionsRequest(after_version=0))
    first = await watch.read()
    watch.cancel()
    assert first.version == MAX_EXACT
    # The run is still usable: claim, complete, pull and commit at the largest step.
    (slot,) = await client.claim("w", 1)
    assert slot.start_policy_version == MAX_EXACT
    async with client.lease(slot) as lease:
        assert (await lease.complete(rollout(slot.lease.slot_id))).group_ready
    code, details = await _refused(
        stub.PullBatch(
            reconciler_pb2.PullBatchRequest(consumer_id="t", step=MAX_EXACT + 1, num_groups=1)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("step: "), details
    batch = await client.pull_batch("t", MAX_EXACT, 1, current_version=MAX_EXACT)
    assert [g.group_id for g in batch.groups] == [gid]
    assert await client.commit("t", MAX_EXACT) == 1
    assert (await client.get_group(gid)).state == reconciler_pb2.GROUP_STATE_COMMITTED


async def test_unknown_enum_values_are_invalid_arguments(client: ReconcilerClient) -> None:
    """Finding 2: an unknown GroupSpec.kind used to be a KeyError (INTERNAL)."""
    for kind in (3, 99, -1):
        request = reconciler_pb2.SubmitGroupsRequest(groups=[spec(k=1, kind=kind)])
        code, details = await _refused(client.stub.SubmitGroups(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith("groups[0].kind: "), details
        claim = reconciler_pb2.ClaimSlotsRequest(worker_id="w", max_slots=1, kinds=[1, kind])
        code, details = await _refused(client.stub.ClaimSlots(claim))
        assert (code, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "kinds[1]")


async def test_garbage_bodies_are_invalid_after_authentication(
    server: ReconcilerProcess,
) -> None:
    """Finding 3: a body that is not protobuf used to be UNKNOWN (with a traceback),
    even for a caller without a token."""
    garbage = b"\xff\xff\xff\xff\x0f"
    authorized = (("authorization", f"Bearer {TOKEN}"),)
    log_before = len(server.log())
    async with aio.insecure_channel(server.target) as channel:
        for method in ("GetGroup", "SubmitGroups", "PublishPolicyVersion"):
            call = channel.unary_unary(RECONCILER + method)
            for _ in range(20):
                code, details = await _refused(call(garbage, metadata=authorized, timeout=5))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, details
                assert details.startswith("request: ") and len(details) < 200, details
            code, _ = await _refused(call(garbage, timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        stream = channel.unary_stream(RECONCILER + "WatchGroups")
        with pytest.raises(aio.AioRpcError) as watch:
            async for _ in stream(garbage, metadata=authorized, timeout=5):
                pass
        assert watch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    written = server.log()[log_before:]
    assert "Traceback" not in written and "ERROR" not in written, written
    assert written.count("WARNING") <= 3, written  # rate-limited


async def test_record_keys_are_checked_where_they_enter(client: ReconcilerClient) -> None:
    """Finding 4: CompleteSlot used to accept a record key the trainer cannot load."""
    bad_keys = ["../../etc/passwd", "a//b", "/etc/passwd", "a/./b", "a\x00b", "x" * 2000, ""]
    for key in bad_keys:
        (gid,) = [f.group_id for f in await client.submit_many([spec(k=1)])]
        (slot,) = await client.claim("w", 1)
        bad = common_pb2.RolloutSummary(
            rollout_id="r", record=common_pb2.ObjectRef(key=key, sha256="0" * 64)
        )
        request = reconciler_pb2.CompleteSlotRequest(
            slot_id=slot.lease.slot_id, lease_token=slot.lease.lease_token, rollout=bad
        )
        code, details = await _refused(client.stub.CompleteSlot(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (key, details)
        assert details.startswith("rollout.record.key: "), details
        assert (await client.get_group(gid)).state == reconciler_pb2.GROUP_STATE_RUNNING
        async with client.lease(slot) as lease:
            assert (await lease.complete(rollout(slot.lease.slot_id))).group_ready


def test_a_record_key_no_store_can_hold_fails_its_slot_not_the_step(tmp_path: Path) -> None:
    """Finding 4: the object store's key check raised a bare ValueError, which the
    trainer's batch loop (it catches RolloutError) let stop training."""
    store = FileObjectStore(tmp_path)
    for key in ["../../etc/passwd", "a//b", "/etc/passwd"]:
        with pytest.raises(RolloutError) as error:
            fetch_record(store, common_pb2.ObjectRef(key=key))
        assert (error.value.reason, error.value.retryable) == ("record_corrupt", False), key


def test_ids_end_where_the_text_ends() -> None:
    """Smaller finding: '^...$' let a trailing newline through."""
    require_identifier("worker-1", "worker_id")
    with pytest.raises(InvalidArgument, match="worker_id"):
        require_identifier("worker-1\n", "worker_id")


@pytest.fixture
async def envs_server() -> AsyncIterator[tuple[str, envs_pb2_grpc.EnvServiceStub]]:
    port = free_port()
    # The sandbox uid must reach the workspaces, which pytest's private tmp_path is not.
    workspaces = Path(tempfile.mkdtemp(prefix="etude-hardening-"))
    workspaces.chmod(0o755)
    config = load_config(
        None,
        {
            "ETUDE_AUTH__TOKEN": TOKEN,
            "ETUDE_RUN__NAME": f"hardening-{uuid.uuid4().hex[:8]}",
            "ETUDE_ENVS__GRPC__HOST": "127.0.0.1",
            "ETUDE_ENVS__GRPC__PORT": str(port),
            "ETUDE_ENVS__HTTP__PORT": "0",
            "ETUDE_ENVS__WORKSPACES_DIR": str(workspaces),
        },
    )
    server = build_server(make_service(EnvsService, config), None).server
    await server.start()
    target = f"127.0.0.1:{port}"
    async with make_channel(target, token=TOKEN) as channel:
        yield target, envs_pb2_grpc.EnvServiceStub(channel)
    await server.stop(0)
    shutil.rmtree(workspaces, ignore_errors=True)


def _task(path: str = "main.py") -> common_pb2.Task:
    return common_pb2.Task(
        task_id="t-1",
        family="synthetic",
        files=[common_pb2.WorkspaceFile(path=path, content=b"x = 1\n")],
        grading=common_pb2.GradingSpec(command=["true"], timeout_s=5),
    )


async def test_envs_refuses_hostile_paths_argv_env_and_timeouts(
    envs_server: tuple[str, envs_pb2_grpc.EnvServiceStub],
) -> None:
    """Finding 5: each of these used to answer INTERNAL."""
    envs = envs_server[1]
    created = await envs.CreateWorkspace(envs_pb2.CreateWorkspaceRequest(task=_task()))
    workspace = created.workspace_id
    cases = [
        (
            envs.CreateWorkspace(envs_pb2.CreateWorkspaceRequest(task=_task("a" * 65536))),
            "task.files[0].path: ",
        ),
        (
            envs.CreateWorkspace(envs_pb2.CreateWorkspaceRequest(task=_task("d/" + "b" * 300))),
            "task.files[0].path: ",
        ),
        (
            envs.Exec(envs_pb2.ExecRequest(workspace_id=workspace, argv=["echo", "a\x00b"])),
            "argv[1]: ",
        ),
        (
            envs.Exec(
                envs_pb2.ExecRequest(workspace_id=workspace, argv=["true"], env={"A" * 32768: "1"})
            ),
            "env[",
        ),
        (
            envs.Exec(
                envs_pb2.ExecRequest(workspace_id=workspace, argv=["true"], env={"A": "b\x00"})
            ),
            "env[",
        ),
        (
            envs.Exec(envs_pb2.ExecRequest(workspace_id=workspace, argv=["x" * (1 << 20)])),
            "argv",
        ),
        (
            envs.Grade(
                envs_pb2.GradeRequest(
                    workspace_id=workspace,
                    grading=common_pb2.GradingSpec(command=["true"], timeout_s=-math.inf),
                )
            ),
            "grading.timeout_s: ",
        ),
        (
            envs.Grade(
                envs_pb2.GradeRequest(
                    workspace_id=workspace,
                    grading=common_pb2.GradingSpec(command=["true"], timeout_s=math.nan),
                )
            ),
            "grading.timeout_s: ",
        ),
    ]
    for call, prefix in cases:
        code, details = await _refused(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (prefix, details)
        assert details.startswith(prefix), details
    ran = await envs.Exec(envs_pb2.ExecRequest(workspace_id=workspace, argv=["true"]))
    assert ran.result.exit_code == 0


async def test_envs_garbage_bodies_are_unauthenticated_without_a_token(
    envs_server: tuple[str, envs_pb2_grpc.EnvServiceStub],
) -> None:
    """Finding 5's last part: garbage got UNKNOWN before authentication on envs too."""
    target = envs_server[0]
    async with aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/etude.v1.EnvService/Exec")
        code, _ = await _refused(call(b"\xff\xff", timeout=5))
        assert code == grpc.StatusCode.UNAUTHENTICATED


def _readiness(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=2
        )
    return int(answer.status)


def _wait_readiness(target: str, status: int, timeout_s: float) -> float:
    started = time.monotonic()
    while _readiness(target) != status:
        assert time.monotonic() - started < timeout_s, f"readiness never became {status}"
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_crashing_reaper_turns_readiness_off_and_is_restarted(
    server: ReconcilerProcess,
) -> None:
    """Deliverable 5: the reaper used to die silently; now it is supervised."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    version_key = f"etude:{{{server.run_name}}}:version"
    client = redis.Redis.from_url(server.redis_url)
    try:
        client.set(version_key, "not a number")  # the reaper's snapshot reads it
        _wait_readiness(server.target, not_serving, 10)
        with urllib.request.urlopen(f"{server.http}/status.json", timeout=5) as answer:
            detail = json.load(answer)["ready_detail"]
        assert "background task reaper crashed" in detail, detail
        client.set(version_key, "0")
        _wait_readiness(server.target, serving, 20)
    finally:
        client.close()
    log = server.log()
    assert "background task reaper crashed" in log and "Traceback" in log
    assert "background task reaper recovered" in log
