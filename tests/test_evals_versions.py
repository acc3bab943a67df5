"""Evals on one version: a version's score uses only the rollouts it sampled alone.

The sorting rules (``services.evals.versions``) on hand-made rollouts, then the evaluator
against a real reconciler process (and its Redis) with a scripted worker that completes
each eval slot as sampled by the versions the script says: crossed and older samples
are asked for again, newer ones are left out, and everything is counted in the record.
Version 0 is scored on more tasks of the same lists.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.envs import EnvsConfig
from services.config.evals import EvalsConfig, SuiteConfig
from services.evals.base_scores import BaseScores
from services.evals.record import EvalRecord
from services.evals.results import ResultsStore, result_key
from services.evals.runner import EvalFailed, Evaluator
from services.evals.scoring import score
from services.evals.suites import Suite, load_suites
from services.evals.versions import DROPPED, TaskSamples, retryable, sampled_by_only
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.weights.manifest import Layout
from services.wire.client import make_channel
from tests.conftest import TOKEN
from tests.reconciler_support import reconciler

SUITE = "synthetic-heldout"
# (min version, max version, correct) of one sample.
Sample = tuple[int, int, bool]


def sample(low: int, high: int, passed: bool = False, tokens: int = 5) -> common_pb2.RolloutSummary:
    return common_pb2.RolloutSummary(
        min_policy_version=low,
        max_policy_version=high,
        stats=common_pb2.RolloutStats(num_generated_tokens=tokens),
        grade=common_pb2.GradeResult(all_passed=passed),
    )


def test_only_rollouts_the_version_sampled_alone_count() -> None:
    assert sampled_by_only(sample(3, 3), 3)
    assert not sampled_by_only(sample(2, 3), 3)  # across the update to 3
    assert not sampled_by_only(sample(3, 4), 3)  # across an update past 3
    assert not sampled_by_only(sample(4, 4), 3)
    assert sampled_by_only(sample(0, 0, tokens=0), 3)  # no token: sampled by no version
    # Asked again, a replica that had not loaded 3 yet serves 3; one past it never does.
    assert retryable(sample(2, 3), 3) and retryable(sample(2, 2), 3)
    assert not retryable(sample(3, 4), 3) and not retryable(sample(4, 4), 3)
    assert not retryable(sample(3, 3), 3)


def test_task_samples_count_retries_and_left_outs() -> None:
    task = TaskSamples(3)
    task.add([sample(3, 3, True), sample(2, 3), sample(2, 2), sample(3, 4), sample(5, 5)])
    assert len(task.kept) == 1 and task.left_out == {"v3-v4": 1, "v5": 1}
    assert task.take_retries() == 2 and task.take_retries() == 0
    task.retried([sample(3, 3)], asked=2)  # one died: it never came back
    assert len(task.kept) == 2 and task.left_out == {"v3-v4": 1, "v5": 1, DROPPED: 1}
    task.add([sample(1, 2)])
    task.finish()  # no retries left
    assert task.num_retried == 2 and task.num_left_out == 4 and task.left_out["v1-v2"] == 1


def test_a_rollout_without_tokens_is_scored_and_sampled_by_no_version() -> None:
    failed = sample(0, 0, tokens=0)
    record = score(
        run="r",
        suite=SUITE,
        family="synthetic",
        version=3,
        num_samples=2,
        ks=[1],
        groups=[
            reconciler_pb2.Group(
                group_id="g", task=common_pb2.Task(task_id="t"), rollouts=[sample(3, 3), failed]
            )
        ],
        dropped_tasks=[],
        is_correct=lambda r: r.grade.all_passed,
        started_at=0.0,
        finished_at=1.0,
    )
    assert record.num_rollouts == 2
    assert (record.generated_by.min_version, record.generated_by.max_version) == (3, 3)


def test_version_0_is_scored_on_more_tasks_of_the_same_lists() -> None:
    suites = load_suites(
        {
            SUITE: SuiteConfig(num_tasks=5),
            "humaneval": SuiteConfig(num_tasks=100),
            "synthetic-novel": SuiteConfig(num_tasks=4, base_num_tasks=6),
        }
    )
    heldout = suites[SUITE]
    base = heldout.base_tasks(4)
    assert len(base) == 20 and [t.task_id for t in base[:5]] == [t.task_id for t in heldout.tasks]
    assert len({t.task_id for t in base}) == 20
    assert len(suites["humaneval"].base_tasks(4)) == 164  # the whole list, no more
    novel = suites["synthetic-novel"]
    assert [t.task_id for t in novel.base_tasks(4)][:4] == [t.task_id for t in novel.tasks]
    assert len(novel.base_tasks(4)) == 6
    with pytest.raises(ValueError, match="base_num_tasks = 3 is below num_tasks = 4"):
        SuiteConfig(num_tasks=4, base_num_tasks=3)


def test_version_0_takes_k_from_tasks_a_list_runs_out_of(tmp_path: Path) -> None:
    def plan(name: str, settings: SuiteConfig, **evals: int) -> tuple[int, int]:
        suite = load_suites({name: settings})[name]
        store = FileObjectStore(tmp_path)
        evaluator = Evaluator(
            run="r",
            suites={name: suite},
            settings=EvalsConfig.model_validate(evals),
            results=ResultsStore(store, "r"),
            weights_store=store,
            on_result=no_result,
        )
        tasks, num_samples = evaluator.base_plan(suite)
        assert evaluator.default_samples(suite, 0) == num_samples
        assert evaluator.default_samples(suite, 1) == suite.num_samples
        return len(tasks), num_samples

    assert plan(SUITE, SuiteConfig(num_tasks=5, num_samples=4)) == (20, 4)
    assert plan(SUITE, SuiteConfig(num_tasks=5), base_samples_multiplier=2) == (20, 8)
    # 164 HumanEval problems, not 400: K makes up for the tasks the list does not have.
    assert plan("humaneval", SuiteConfig(num_tasks=100, num_samples=2)) == (164, 6)
    assert plan("humaneval", SuiteConfig(num_tasks=100, base_num_tasks=100)) == (100, 4)
    assert plan(SUITE, SuiteConfig(num_tasks=5), base_tasks_multiplier=1) == (5, 4)


async def no_result(record: EvalRecord) -> None:
    pass


class ScriptedWorker:
    """Claims eval slots and completes each as the next sample of its task's script."""

    def __init__(self, client: ReconcilerClient, script: dict[str, Sequence[Sample]]) -> None:
        self.client = client
        self.script = {task_id: deque(samples) for task_id, samples in script.items()}
        self.completed: defaultdict[str, int] = defaultdict(int)

    async def run(self) -> None:
        while True:
            claimed = await self.client.claim("scripted", max_slots=100, lease_ttl_s=30)
            for slot in sorted(claimed, key=lambda s: (s.task.task_id, s.lease.sample_index)):
                task_id = slot.task.task_id
                low, high, passed = self.script[task_id].popleft()
                rollout = sample(low, high, passed)
                rollout.rollout_id = f"r-{task_id.replace('/', '-')}-{self.completed[task_id]}"
                rollout.group_id = slot.lease.group_id
                rollout.sample_index = slot.lease.sample_index
                rollout.task_id = task_id
                rollout.finish_reason = "finished"
                rollout.record.CopyFrom(
                    common_pb2.ObjectRef(
                        key=f"rollouts/{rollout.rollout_id}",
                        size_bytes=1,
                        sha256=hashlib.sha256(rollout.rollout_id.encode()).hexdigest(),
                    )
                )
                async with self.client.lease(slot) as lease:
                    await lease.complete(rollout)
                self.completed[task_id] += 1
            await asyncio.sleep(0.05)


async def evaluate_with(
    target: str,
    run_name: str,
    store_dir: Path,
    suite: Suite,
    script: dict[str, Sequence[Sample]],
    check: Callable[[Evaluator, ScriptedWorker], Awaitable[None]],
) -> None:
    store = FileObjectStore(store_dir)
    async with make_channel(target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        notice = common_pb2.PolicyVersionNotice(
            version=1, manifest_key=Layout(run_name).manifest(1)
        )
        await client.publish_version(notice)
        for version in (0, 1):
            store.put(Layout(run_name).manifest(version), b"{}")

        evaluator = Evaluator(
            run=run_name,
            suites={suite.name: suite},
            settings=EvalsConfig(version_retries=2, eval_timeout_s=60, base_tasks_multiplier=2),
            results=ResultsStore(store, run_name),
            weights_store=store,
            on_result=no_result,
        )
        evaluator.reconciler = client
        worker = ScriptedWorker(client, script)
        working = asyncio.create_task(worker.run())
        try:
            await check(evaluator, worker)
        finally:
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)


def test_crossed_samples_are_retried_and_the_rest_left_out(tmp_path: Path) -> None:
    suite = load_suites({SUITE: SuiteConfig(num_tasks=3, num_samples=2)})[SUITE]
    a, b, c = (t.task_id for t in suite.tasks)
    script: dict[str, Sequence[Sample]] = {
        # One sample crossed the update to 1 (inference had not loaded it): asked again.
        a: [(1, 1, True), (0, 1, False), (1, 1, True)],
        # Inference moved past 1: neither sample is retried, and the task is unscored.
        b: [(2, 2, True), (1, 2, True)],
        # Sampled by 0 three times: two retries, then left out.
        c: [(0, 0, True), (1, 1, False), (0, 1, True), (0, 0, True)],
    }

    async def check(evaluator: Evaluator, worker: ScriptedWorker) -> None:
        record, _ = await evaluator.request(SUITE, 1)
        assert (record.policy_version, record.num_samples) == (1, 2)
        assert (record.generated_by.min_version, record.generated_by.max_version) == (1, 1)
        assert record.num_retried == 3
        assert record.num_left_out == 3
        assert record.left_out_by == {"v2": 1, "v1-v2": 1, "v0": 1}
        assert record.left_out_tasks == [b] and record.dropped_tasks == []
        assert [(t.task_id, t.num_correct, t.num_samples) for t in record.tasks] == [
            (a, 2, 2),
            (c, 0, 1),
        ]
        assert record.num_rollouts == 3
        assert record.pass_at_1 == pytest.approx(0.5)
        assert record.pass_at_1_interval is not None
        assert (record.pass_at_1_interval.low, record.pass_at_1_interval.high) == (0.0, 1.0)
        assert set(record.pass_at_k) == {1}  # c kept one sample: pass@2 is not defined
        assert all(not queue for queue in worker.script.values())  # every scripted sample
        # Again, with the record gone: the same groups (and retry groups) are found.
        evaluator.results.store.delete([result_key(evaluator.run, SUITE, 1)])
        again, _ = await evaluator.request(SUITE, 1)
        assert sum(worker.completed.values()) == 9
        same = {"started_at", "finished_at"}
        assert again.model_dump(exclude=same) == record.model_dump(exclude=same)

    with reconciler(tmp_path) as server:
        asyncio.run(
            evaluate_with(server.target, server.run_name, tmp_path / "store", suite, script, check)
        )


def test_version_0_takes_more_tasks(tmp_path: Path) -> None:
    suite = load_suites({SUITE: SuiteConfig(num_tasks=2, num_samples=1)})[SUITE]
    tasks = suite.base_tasks(2)
    script: dict[str, Sequence[Sample]] = {
        t.task_id: [(0, 0, index % 2 == 0)] for index, t in enumerate(tasks)
    }

    async def check(evaluator: Evaluator, worker: ScriptedWorker) -> None:
        record, _ = await evaluator.request(SUITE, 0)
        assert [t.task_id for t in record.tasks] == [t.task_id for t in tasks]
        assert record.num_tasks == 4 and record.pass_at_1 == 0.5 and record.num_retried == 0

    with reconciler(tmp_path) as server:
        asyncio.run(
            evaluate_with(server.target, server.run_name, tmp_path / "store", suite, script, check)
        )


def test_an_eval_with_no_sample_of_its_version_fails(tmp_path: Path) -> None:
    suite = load_suites({SUITE: SuiteConfig(num_tasks=1, num_samples=2)})[SUITE]
    (task,) = suite.tasks
    # A replica stuck on version 0: both samples and both rounds of retries are its.
    script: dict[str, Sequence[Sample]] = {task.task_id: [(0, 0, True)] * 6}

    async def check(evaluator: Evaluator, worker: ScriptedWorker) -> None:
        with pytest.raises(
            EvalFailed, match=r"4 samples retried; left out, by version: \{'v0': 2\}"
        ):
            await evaluator.request(SUITE, 1)
        assert await evaluator.results.load(SUITE, 1) is None

    with reconciler(tmp_path) as server:
        asyncio.run(
            evaluate_with(server.target, server.run_name, tmp_path / "store", suite, script, check)
        )


def publish_base(store: FileObjectStore, run: str, value: float = 0.5) -> None:
    """Version 0 of `run`: one small tensor, published as the trainer does."""
    import torch

    from services.config import WeightsConfig
    from services.weights.publisher import WeightPublisher

    publisher = WeightPublisher(store, run, WeightsConfig())
    try:
        weights = {"w": torch.full((8,), value, dtype=torch.bfloat16)}
        assert publisher.publish(weights, 0).result(60).manifest_written
    finally:
        publisher.close()


def base_key(store: FileObjectStore, run: str, suite: Suite, envs: EnvsConfig, k: int = 1) -> str:
    from services.weights.manifest import read_manifest

    manifest = read_manifest(store, Layout(run), 0)
    return BaseScores(store, envs).key(manifest, suite, suite.base_tasks(2), k, [1])


def test_the_base_score_key_names_weights_tasks_and_settings_not_the_run(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    suite = load_suites({SUITE: SuiteConfig(num_tasks=2, num_samples=1)})[SUITE]
    publish_base(store, "a")
    publish_base(store, "b")
    publish_base(store, "other-weights", value=0.25)
    envs = EnvsConfig()
    key = base_key(store, "a", suite, envs)
    assert base_key(store, "b", suite, envs) == key  # another run, the same base model
    assert base_key(store, "a", suite, envs.model_copy(update={"workers": 3})) == key
    sandbox = envs.sandbox.model_copy(update={"uid": 1000, "backend": "pod"})
    assert base_key(store, "a", suite, envs.model_copy(update={"sandbox": sandbox})) == key
    others = {
        "weights": base_key(store, "other-weights", suite, envs),
        "K": base_key(store, "a", suite, envs, k=2),
        "tasks": base_key(
            store, "a", load_suites({SUITE: SuiteConfig(num_tasks=2, seed=1)})[SUITE], envs
        ),
        "harness": base_key(
            store,
            "a",
            suite,
            envs.model_copy(
                update={"harness": envs.harness.model_copy(update={"temperature": 0.7})}
            ),
        ),
        "sandbox limits": base_key(
            store,
            "a",
            suite,
            envs.model_copy(update={"sandbox": envs.sandbox.model_copy(update={"cpu_s": 5})}),
        ),
    }
    assert all(other != key for other in others.values()), others
    assert len(set(others.values())) == len(others)


def test_version_0_is_scored_once_per_base_model_across_runs(tmp_path: Path) -> None:
    suite = load_suites({SUITE: SuiteConfig(num_tasks=2, num_samples=1)})[SUITE]
    tasks = suite.base_tasks(2)
    script: dict[str, Sequence[Sample]] = {
        t.task_id: [(0, 0, index % 2 == 0)] for index, t in enumerate(tasks)
    }
    store_dir = tmp_path / "store"
    store = FileObjectStore(store_dir)

    def evaluator(run: str, client: ReconcilerClient, envs: EnvsConfig) -> Evaluator:
        made = Evaluator(
            run=run,
            suites={suite.name: suite},
            settings=EvalsConfig(eval_timeout_s=60, base_tasks_multiplier=2),
            results=ResultsStore(store, run),
            weights_store=store,
            on_result=no_result,
            base_scores=BaseScores(store, envs),
        )
        made.reconciler = client
        return made

    def reused() -> float:
        labels = {"suite": SUITE}
        return REGISTRY.get_sample_value("etude_evals_base_scores_reused_total", labels) or 0.0

    async def scenario(target: str, run_name: str) -> None:
        async with make_channel(target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            worker = ScriptedWorker(client, script)
            working = asyncio.create_task(worker.run())
            try:
                first, _ = await evaluator(run_name, client, EnvsConfig()).request(SUITE, 0)
                assert first.reused_from is None and first.num_tasks == 4
                assert sum(worker.completed.values()) == 4
                before = reused()

                # Another run from the same base model: the kept score, nothing sampled.
                publish_base(store, "seed-1")
                again, _ = await evaluator("seed-1", client, EnvsConfig()).request(SUITE, 0)
                assert (again.run, again.reused_from) == ("seed-1", run_name)
                same = {"run", "reused_from"}
                assert again.model_dump(exclude=same) == first.model_dump(exclude=same)
                assert await ResultsStore(store, "seed-1").load(SUITE, 0) is not None
                assert sum(worker.completed.values()) == 4
                assert reused() == before + 1

                # Other rollout settings: not the same eval, so version 0 is scored anew.
                publish_base(store, "seed-2")
                hotter = EnvsConfig.model_validate({"harness": {"temperature": 0.5}})
                fresh, _ = await evaluator("seed-2", client, hotter).request(SUITE, 0)
                assert fresh.reused_from is None
                assert reused() == before + 1
            finally:
                working.cancel()
                await asyncio.gather(working, return_exceptions=True)

    with reconciler(tmp_path) as server:
        publish_base(store, server.run_name)
        asyncio.run(scenario(server.target, server.run_name))
