"""The EnvService API on the running envs process: create, fork, exec, grade, delete."""

from __future__ import annotations

import grpc
import pytest

from services.api.v1 import common_pb2, envs_pb2, envs_pb2_grpc
from services.families import load_family
from tests.conftest import TOKEN, Deployment

pytestmark = pytest.mark.integration
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def test_workspace_lifecycle_over_grpc(deployment: Deployment) -> None:
    family = load_family("synthetic")
    task = family.tasks("heldout")[0]
    with grpc.insecure_channel(deployment.target("envs")) as channel:
        stub = envs_pb2_grpc.EnvServiceStub(channel)
        created = stub.CreateWorkspace(envs_pb2.CreateWorkspaceRequest(task=task), metadata=AUTH)
        snapshot = stub.SnapshotWorkspace(
            envs_pb2.SnapshotWorkspaceRequest(workspace_id=created.workspace_id), metadata=AUTH
        ).snapshot_id
        forks = stub.ForkWorkspace(
            envs_pb2.ForkWorkspaceRequest(source_id=snapshot, num_forks=2), metadata=AUTH
        ).workspace_ids
        assert len(forks) == 2
        # Untouched stub: the tests fail, with a score of 0.
        before = stub.Grade(envs_pb2.GradeRequest(workspace_id=forks[0]), metadata=AUTH).result
        assert before.score == 0.0 and not before.all_passed
        # Write the canonical solution into one fork from inside the sandbox. Forked files
        # are shared read-only until replaced, so it is written by replacing the file.
        solution = family.solution_files(task, family.canonical_completion(task) or "")[0]
        wrote = stub.Exec(
            envs_pb2.ExecRequest(
                workspace_id=forks[0],
                argv=["sh", "-c", f"cat > new && mv new {solution.path}"],
                stdin=solution.content,
                timeout_s=10,
            ),
            metadata=AUTH,
        ).result
        assert wrote.exit_code == 0, wrote.stderr
        after = stub.Grade(envs_pb2.GradeRequest(workspace_id=forks[0]), metadata=AUTH).result
        assert after.score == 1.0 and after.all_passed
        sibling = stub.Grade(envs_pb2.GradeRequest(workspace_id=forks[1]), metadata=AUTH).result
        assert sibling.score == 0.0  # forks do not share writes
        offline = stub.Exec(
            envs_pb2.ExecRequest(
                workspace_id=forks[1],
                argv=[
                    "python3",
                    "-c",
                    "import socket; socket.create_connection(('1.1.1.1', 53), 2)",
                ],
            ),
            metadata=AUTH,
        ).result
        assert offline.exit_code != 0  # no network in the sandbox
        for workspace_id in (*forks, created.workspace_id, snapshot):
            stub.DeleteWorkspace(
                envs_pb2.DeleteWorkspaceRequest(workspace_id=workspace_id), metadata=AUTH
            )
        with pytest.raises(grpc.RpcError) as gone:
            stub.Grade(envs_pb2.GradeRequest(workspace_id=forks[0]), metadata=AUTH)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        status = stub.GetStatus(common_pb2.StatusRequest(), metadata=AUTH)
        assert status.sandbox_backend == "bubblewrap"
