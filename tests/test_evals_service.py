"""The evals service through the real pipeline: a real reconciler and Redis, the real
envs rollout worker, sandbox and grader, and a scripted policy behind a real gRPC
InferenceService (tests/evals_support.py) that answers with canonical, wrong or broken
solutions. Publishing a version (manifest + notice, as the trainer does) makes the
service score it; the scores must be exactly what the script implies."""

from __future__ import annotations

import asyncio
import html.parser
import io
import json
import math
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from PIL import Image

from services.api.v1 import common_pb2, evals_pb2, evals_pb2_grpc
from services.evals.results import discover
from services.evals.suites import load_suites
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel
from tests.conftest import REPO, TOKEN, service_env, stop_process, wait_ready, write_config
from tests.evals_support import Plan, ScriptedStack, count_correct
from tests.reconciler_support import ReconcilerProcess, reconciler

pytestmark = pytest.mark.integration

AUTH = (("authorization", f"Bearer {TOKEN}"),)
SYNTHETIC, HUMANEVAL, NOVEL = "synthetic-heldout", "humaneval", "synthetic-novel"
SUITES = {SYNTHETIC: (4, 4), HUMANEVAL: (3, 2)}  # (tasks, K)
KS = [1, 2, 4]


def plans(tasks: dict[str, list[str]]) -> Plan:
    """Version 1 solves some samples; version 2 more. 'broken' does not even parse."""
    s, h = tasks[SYNTHETIC], tasks[HUMANEVAL]
    return {
        1: {
            s[0]: ["right"] * 4,
            s[1]: ["right", "right", "wrong", "wrong"],
            s[2]: ["right", "wrong", "broken", "wrong"],
            s[3]: ["wrong", "wrong", "wrong", "broken"],
            h[0]: ["right", "right"],
            h[1]: ["right", "wrong"],
            h[2]: ["broken", "wrong"],
        },
        2: {
            s[0]: ["right"] * 4,
            s[1]: ["right"] * 4,
            s[2]: ["right", "right", "wrong", "wrong"],
            s[3]: ["right", "wrong", "wrong", "wrong"],
            h[0]: ["right", "right"],
            h[1]: ["right", "right"],
            h[2]: ["right", "wrong"],
        },
    }


def expected(plan: Plan, version: int, task_ids: list[str], k: int) -> float:
    """Mean over tasks of the closed form 1 - C(n-c, k) / C(n, k)."""
    values = []
    for task_id in task_ids:
        outcomes = plan[version][task_id]
        n, c = len(outcomes), count_correct(outcomes)
        values.append(1 - math.comb(n - c, k) / math.comb(n, k))
    return sum(values) / len(values)


@dataclass
class Pipeline:
    run_name: str
    config_path: Path
    store: FileObjectStore
    target: str
    http: str
    control: ReconcilerProcess
    stack: ScriptedStack
    plan: Plan
    task_ids: dict[str, list[str]]
    log_path: Path

    def stub(self, channel: grpc.Channel) -> evals_pb2_grpc.EvalsServiceStub:
        return evals_pb2_grpc.EvalsServiceStub(channel)

    def results(self, suite: str = "") -> list[evals_pb2.EvalResult]:
        with grpc.insecure_channel(self.target) as channel:
            answer = self.stub(channel).GetResults(
                evals_pb2.GetResultsRequest(suite=suite), metadata=AUTH, timeout=30
            )
        return list(answer.results)

    def publish(self, version: int) -> None:
        """What the trainer does: the version's weights and manifest, then the notice."""
        import torch

        from services.config import WeightsConfig
        from services.weights.manifest import Layout
        from services.weights.publisher import WeightPublisher

        self.stack.inference.serving_version = version  # the replica loads it
        publisher = WeightPublisher(self.store, self.run_name, WeightsConfig())
        try:
            weights = {"w": torch.full((8,), float(version), dtype=torch.bfloat16)}
            assert publisher.publish(weights, version).result(60).manifest_written
        finally:
            publisher.close()

        async def notify() -> None:
            async with make_channel(self.control.target, token=TOKEN) as channel:
                notice = common_pb2.PolicyVersionNotice(
                    version=version, manifest_key=Layout(self.run_name).manifest(version)
                )
                await ReconcilerClient(channel).publish_version(notice)

        asyncio.run(notify())

    def wait_done(self, version: int, timeout_s: float = 150) -> dict[str, evals_pb2.EvalResult]:
        deadline = time.monotonic() + timeout_s
        while True:
            done = {
                r.suite: r
                for r in self.results()
                if r.policy_version == version and r.state == evals_pb2.EVAL_STATE_DONE
            }
            if set(done) == set(SUITES):
                return done
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"version {version} not scored in {timeout_s} s: {self.results()}\n"
                    + self.log_path.read_text()[-4000:]
                )
            time.sleep(0.5)


@pytest.fixture(scope="module")
def pipeline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("evals")
    run_name = f"evals-{uuid.uuid4().hex[:8]}"
    suites = load_suites({})
    task_ids = {
        name: [t.task_id for t in suites[name].tasks[:num_tasks]]
        for name, (num_tasks, _) in SUITES.items()
    }
    tasks = [t for name, (n, _) in SUITES.items() for t in suites[name].tasks[:n]]
    plan = plans(task_ids)
    with (
        reconciler(root, run_name=run_name) as control,
        ScriptedStack(
            reconciler_target=control.target,
            store_dir=root / "state" / "store",
            run_name=run_name,
            tokenizer=AutoTokenizer.from_pretrained(tiny_model),
            tasks=tasks,
            plan=plan,
        ) as stack,
    ):
        config_path = root / "config.toml"
        suite_sections = {
            f"evals.suites.{name}": [f"num_tasks = {n}", f"num_samples = {k}"]
            for name, (n, k) in SUITES.items()
        }
        # Known but not watched: the scripted stack has no plan for its tasks.
        suite_sections[f"evals.suites.{NOVEL}"] = ["enabled = false"]
        ports = write_config(
            config_path,
            model_dir=tiny_model,
            state_dir=root / "state",
            run_name=run_name,
            extra={
                "endpoints": [
                    f'reconciler = "{control.target}"',
                    f'inference = "{stack.target}"',
                ],
                "evals": [f"pass_at_k = {KS}", "eval_timeout_s = 300"],
                **suite_sections,
            },
        )
        log_path = root / "evals.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "services.evals", "--config", str(config_path)],
                cwd=REPO,
                env=service_env(TOKEN),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            grpc_port, http_port = ports["evals"]
            wait_ready(f"127.0.0.1:{grpc_port}", 60, process, log_path)
            yield Pipeline(
                run_name=run_name,
                config_path=config_path,
                store=FileObjectStore(root / "state" / "store"),
                target=f"127.0.0.1:{grpc_port}",
                http=f"http://127.0.0.1:{http_port}",
                control=control,
                stack=stack,
                plan=plan,
                task_ids=task_ids,
                log_path=log_path,
            )
        finally:
            assert stop_process(process) == 0, log_path.read_text()[-4000:]


def check_scores(pipeline: Pipeline, version: int, result: evals_pb2.EvalResult) -> None:
    suite = result.suite
    task_ids = pipeline.task_ids[suite]
    plan = pipeline.plan[version]
    num_tasks, k_samples = SUITES[suite]
    assert result.eval_id == f"{suite}:v{version}"
    assert (result.num_tasks, result.num_samples) == (num_tasks, k_samples)
    assert result.pass_at_1 == pytest.approx(expected(pipeline.plan, version, task_ids, 1))
    assert set(result.pass_at_k) == {k for k in KS if k <= k_samples}
    for k in result.pass_at_k:
        assert result.pass_at_k[k] == pytest.approx(expected(pipeline.plan, version, task_ids, k))
    assert result.best_of_k == pytest.approx(
        sum(count_correct(plan[t]) > 0 for t in task_ids) / num_tasks
    )
    assert [(t.task_id, t.num_samples, t.num_correct) for t in result.tasks] == [
        (t, k_samples, count_correct(plan[t])) for t in task_ids
    ]
    outcomes = [o for t in task_ids for o in plan[t]]
    assert dict(result.failure_reasons) == {
        reason: count
        for reason, count in (
            ("tests_failed", outcomes.count("wrong")),
            ("syntax_error", outcomes.count("broken")),
        )
        if count
    }
    # One turn each: write_file, then finish.
    assert (result.mean_turns, result.mean_tool_calls, result.mean_summaries) == (1, 2, 0)
    assert result.mean_tokens > 0
    reward = result.mean_reward
    assert reward.task <= result.pass_at_1 + 1e-9 or suite == SYNTHETIC
    assert reward.total == pytest.approx(reward.task + reward.length_penalty + reward.behaviour)


def test_every_published_version_is_scored(pipeline: Pipeline) -> None:
    with grpc.insecure_channel(pipeline.target) as channel:
        listed = pipeline.stub(channel).ListSuites(
            evals_pb2.ListSuitesRequest(), metadata=AUTH, timeout=10
        )
    assert {(s.name, s.family, s.num_tasks, s.default_num_samples) for s in listed.suites} == {
        (SYNTHETIC, "synthetic", 4, 4),
        (HUMANEVAL, "humaneval", 3, 2),
        (NOVEL, "synthetic", 100, 4),
        ("multifile-heldout", "multifile", 100, 2),  # listed, not watched by default
    }
    for version in (1, 2):
        pipeline.publish(version)
        for result in pipeline.wait_done(version).values():
            check_scores(pipeline, version, result)
    assert pipeline.stack.inference.unplanned == 0
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(pipeline.target) as channel:
        while True:  # the watcher is done once the report of its results is rendered too
            status = pipeline.stub(channel).GetStatus(common_pb2.StatusRequest(), metadata=AUTH)
            if status.num_running_evals == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert status.last_evaluated_version == 2 and status.num_running_evals == 0
    assert status.info.ready


def test_results_are_stored_and_exported(pipeline: Pipeline) -> None:
    newest = {r.suite: r for r in pipeline.results() if r.policy_version == 2}
    for suite in SUITES:
        key = f"evals/{pipeline.run_name}/{suite}/v2.json"
        data = pipeline.store.get(key)
        assert newest[suite].stored.key == key
        assert len(data) == newest[suite].stored.size_bytes
        stored = json.loads(data)
        assert stored["policy_version"] == 2 and stored["suite"] == suite
        # The scripted replica served v2 for every token of this eval, and the JSON says so.
        assert stored["generated_by"]["min_version"] == stored["generated_by"]["max_version"]
        assert stored["generated_by"]["max_version"] == 2 and stored["generated_by"]["note"]
        assert discover(pipeline.store, pipeline.run_name)[suite] == {
            1: f"evals/{pipeline.run_name}/{suite}/v1.json",
            2: key,
        }
    with urllib.request.urlopen(f"{pipeline.http}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    synthetic = newest[SYNTHETIC]
    for line in (
        f'etude_evals_version{{suite="{SYNTHETIC}"}} 2.0',
        f'etude_evals_pass_at_1{{suite="{SYNTHETIC}"}} {synthetic.pass_at_1!r}',
        f'etude_evals_pass_at_k{{k="4",suite="{SYNTHETIC}"}} {synthetic.pass_at_k[4]!r}',
        f'etude_evals_best_of_k{{suite="{HUMANEVAL}"}} {newest[HUMANEVAL].best_of_k!r}',
        f'etude_evals_mean_reward{{part="task",suite="{SYNTHETIC}"}} '
        f"{synthetic.mean_reward.task!r}",
        f'etude_evals_runs_total{{state="DONE",suite="{HUMANEVAL}"}} 2.0',
    ):
        assert line in metrics.splitlines(), line


def reconciler_groups(pipeline: Pipeline) -> int:
    async def count() -> int:
        async with make_channel(pipeline.control.target, token=TOKEN) as channel:
            status = await ReconcilerClient(channel).stub.GetStatus(common_pb2.StatusRequest())
            return sum(status.groups_by_state.values())

    return asyncio.run(count())


def test_rerunning_an_eval_does_not_double_count(pipeline: Pipeline) -> None:
    before = {r.suite: r for r in pipeline.results() if r.policy_version == 1}
    samples, groups = sum(pipeline.stack.inference.requests.values()), reconciler_groups(pipeline)
    with grpc.insecure_channel(pipeline.target) as channel:
        stub = pipeline.stub(channel)
        again = stub.RunEval(
            evals_pb2.RunEvalRequest(policy_version=1, suite=SYNTHETIC, wait=True),
            metadata=AUTH,
            timeout=60,
        )
        assert again.result.pass_at_k == before[SYNTHETIC].pass_at_k
        # Lose the stored result, as if the service died before writing it: running the
        # eval again finds the same groups (idempotency keys) and scores the same rollouts.
        pipeline.store.delete([before[SYNTHETIC].stored.key])
        rescored = stub.RunEval(
            evals_pb2.RunEvalRequest(policy_version=1, suite=SYNTHETIC, num_samples=4, wait=True),
            metadata=AUTH,
            timeout=120,
        ).result
        with pytest.raises(grpc.RpcError) as other_k:
            stub.RunEval(
                evals_pb2.RunEvalRequest(policy_version=1, suite=SYNTHETIC, num_samples=3),
                metadata=AUTH,
                timeout=30,
            )
    assert other_k.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "K = 4" in other_k.value.details()
    for field in ("pass_at_1", "best_of_k", "num_tasks", "num_samples", "mean_tokens"):
        assert getattr(rescored, field) == getattr(before[SYNTHETIC], field), field
    assert rescored.pass_at_k == before[SYNTHETIC].pass_at_k
    assert list(rescored.tasks) == list(before[SYNTHETIC].tasks)
    assert sum(pipeline.stack.inference.requests.values()) == samples  # no new rollouts
    assert reconciler_groups(pipeline) == groups  # no new groups
    assert pipeline.store.exists(before[SYNTHETIC].stored.key)


def test_unknown_suite_and_unpublished_version_are_not_found(pipeline: Pipeline) -> None:
    with grpc.insecure_channel(pipeline.target) as channel:
        stub = pipeline.stub(channel)
        with pytest.raises(grpc.RpcError) as unknown:
            stub.RunEval(
                evals_pb2.RunEvalRequest(policy_version=1, suite="behaviour"), metadata=AUTH
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert unknown.value.details() == (
            "unknown suite 'behaviour'; known suites: humaneval, multifile-heldout, "
            "synthetic-heldout, synthetic-novel"
        )
        with pytest.raises(grpc.RpcError) as unpublished:
            stub.RunEval(
                evals_pb2.RunEvalRequest(policy_version=99, suite=HUMANEVAL), metadata=AUTH
            )
        assert unpublished.value.code() == grpc.StatusCode.NOT_FOUND
        assert "policy version 99" in unpublished.value.details()
        assert "never published" in unpublished.value.details()
        assert "the newest is 2" in unpublished.value.details()
        with pytest.raises(grpc.RpcError) as results_of_unknown:
            stub.GetResults(evals_pb2.GetResultsRequest(suite="behaviour"), metadata=AUTH)
        assert results_of_unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # Nothing was started for them.
        assert not [r for r in pipeline.results() if r.policy_version == 99]


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.cells: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"] or "")

    def handle_data(self, data: str) -> None:
        self.cells.append(data)


def check_report(pipeline: Pipeline, page: bytes, fetch: object) -> None:
    parser = _Page()
    parser.feed(page.decode())
    assert {"pass_at_1.png", "pass_at_2.png", "pass_at_4.png", "best_of_k.png"} <= set(
        parser.images
    )
    for name in parser.images:
        image = Image.open(io.BytesIO(fetch(name)))  # type: ignore[operator]
        image.load()  # decodes every pixel: a truncated or bogus PNG fails here
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100
    text = " ".join(parser.cells)
    for task_id in pipeline.task_ids[SYNTHETIC] + pipeline.task_ids[HUMANEVAL]:
        assert task_id in text  # the per-task tables
    results = json.loads(fetch("results.json"))  # type: ignore[operator]
    assert {
        suite: [r["policy_version"] for r in rs] for suite, rs in results["suites"].items()
    } == {
        SYNTHETIC: [1, 2],
        HUMANEVAL: [1, 2],
    }


def test_the_service_serves_the_latest_report(pipeline: Pipeline) -> None:
    with grpc.insecure_channel(pipeline.target) as channel:
        report = pipeline.stub(channel).GetReport(evals_pb2.GetReportRequest(), metadata=AUTH)
    assert report.url.endswith("/report/")
    assert pipeline.store.get(report.html.key).startswith(b"<!doctype html>")

    def fetch(name: str) -> bytes:
        with urllib.request.urlopen(f"{pipeline.http}/report/{name}", timeout=10) as response:
            return bytes(response.read())

    with urllib.request.urlopen(f"{pipeline.http}/report/", timeout=10) as response:
        page = response.read()
    check_report(pipeline, page, fetch)


def etude(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_writes_the_report(pipeline: Pipeline, tmp_path: Path) -> None:
    out = tmp_path / "report"
    config = str(pipeline.config_path)
    done = etude("evals", "report", "--run", pipeline.run_name, "--out", str(out), "-c", config)
    assert done.returncode == 0, done.stderr
    assert str(out / "index.html") in done.stdout
    check_report(
        pipeline, (out / "index.html").read_bytes(), lambda name: (out / name).read_bytes()
    )
    missing = etude("evals", "report", "--run", "no-such-run", "--out", str(out), "-c", config)
    assert missing.returncode == 1 and "no eval results for run 'no-such-run'" in missing.stderr
