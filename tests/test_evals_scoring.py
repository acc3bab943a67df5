"""Eval metrics without services: the pass@k estimator, scoring of groups, the suites."""

from __future__ import annotations

import math

import pytest

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.evals import EvalsConfig, SuiteConfig
from services.evals.scoring import TESTS_FAILED, pass_at_k, score
from services.evals.suites import load_suites
from services.families.multifile import MultiFileFamily


def closed_form(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), in exact integers."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 20, 100])
def test_pass_at_k_matches_the_closed_form(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_known_values() -> None:
    assert pass_at_k(4, 2, 1) == 0.5
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(200, 3, 100) == pytest.approx(closed_form(200, 3, 100))


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_undefined_cases(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def rollout(
    task_id: str,
    score_: float,
    *,
    passed: bool,
    reason: str = "",
    versions: tuple[int, int] = (3, 3),
    tokens: int = 10,
) -> common_pb2.RolloutSummary:
    return common_pb2.RolloutSummary(
        task_id=task_id,
        reward=common_pb2.RewardParts(
            task=score_,
            length_penalty=-0.1,
            behaviour=-0.5 if not passed else 0.0,
            behaviour_parts={"terminal_only": -0.5} if not passed else {},
            total=score_ - 0.1 - (0.5 if not passed else 0.0),
        ),
        stats=common_pb2.RolloutStats(
            num_turns=2, num_tool_calls=3, num_summaries=1, num_generated_tokens=tokens
        ),
        finish_reason="finished",
        min_policy_version=versions[0],
        max_policy_version=versions[1],
        grade=common_pb2.GradeResult(
            num_tests=4,
            num_passed=4 if passed else 1,
            score=score_,
            all_passed=passed,
            failure_reason=reason,
        ),
    )


def group(task_id: str, rollouts: list[common_pb2.RolloutSummary]) -> reconciler_pb2.Group:
    return reconciler_pb2.Group(
        group_id=f"g-{task_id}", task=common_pb2.Task(task_id=task_id), rollouts=rollouts
    )


def test_score_of_known_groups() -> None:
    groups = [
        group("a", [rollout("a", 1.0, passed=True) for _ in range(4)]),
        group(
            "b",
            [
                rollout("b", 1.0, passed=True),
                rollout("b", 1.0, passed=True, versions=(3, 5)),
                rollout("b", 0.25, passed=False),
                rollout("b", 0.0, passed=False, reason="timeout"),
            ],
        ),
        group("c", [rollout("c", 0.5, passed=False) for _ in range(4)]),
    ]
    record = score(
        run="r",
        suite="s",
        family="synthetic",
        version=3,
        num_samples=4,
        ks=[1, 2, 4, 8],
        groups=groups,
        dropped_tasks=["d"],
        is_correct=lambda r: r.grade.all_passed,
        started_at=0.0,
        finished_at=1.0,
    )
    assert record.eval_id == "s:v3" and record.num_tasks == 3 and record.num_rollouts == 12
    assert record.pass_at_1 == pytest.approx((1 + 0.5 + 0) / 3)
    assert set(record.pass_at_k) == {1, 2, 4}  # 8 > K: left out, not guessed
    assert record.pass_at_k[2] == pytest.approx((1 + closed_form(4, 2, 2) + 0) / 3)
    assert record.pass_at_k[4] == pytest.approx(2 / 3)
    assert record.best_of_k == pytest.approx((1 + 1 + 0.5) / 3)  # the best sample's score
    assert record.mean_reward.task == pytest.approx((4 + 2.25 + 2) / 12)
    assert record.mean_reward.behaviour_parts == {"terminal_only": pytest.approx(-0.5 * 6 / 12)}
    total = record.mean_reward
    assert total.total == pytest.approx(total.task + total.length_penalty + total.behaviour)
    assert (record.mean_turns, record.mean_tool_calls, record.mean_summaries) == (2, 3, 1)
    assert record.failure_reasons == {TESTS_FAILED: 5, "timeout": 1}
    assert record.finish_reasons == {"finished": 12}
    assert (record.generated_by.min_version, record.generated_by.max_version) == (3, 5)
    assert record.dropped_tasks == ["d"]
    assert [(t.task_id, t.num_correct, t.num_samples) for t in record.tasks] == [
        ("a", 4, 4),
        ("b", 2, 4),
        ("c", 0, 4),
    ]
    proto = record.to_proto()
    assert proto.pass_at_k[2] == pytest.approx(record.pass_at_k[2])
    assert [t.num_correct for t in proto.tasks] == [4, 2, 0]


def test_suites_are_fixed_lists() -> None:
    suites = load_suites({})
    assert set(suites) == {"synthetic-heldout", "synthetic-novel", "humaneval", "multifile-heldout"}
    humaneval = suites["humaneval"]
    assert len(humaneval.tasks) == 164 and humaneval.tasks[0].task_id == "HumanEval/0"
    assert {t.split for s in suites.values() for t in s.tasks} == {"heldout", "novel"}
    assert all(t.split == "novel" for t in suites["synthetic-novel"].tasks)
    again = load_suites({})
    for name, suite in suites.items():  # the same tasks in the same order, every time
        assert [t.SerializeToString() for t in suite.tasks] == [
            t.SerializeToString() for t in again[name].tasks
        ]
    small = load_suites({"synthetic-heldout": SuiteConfig(num_tasks=5, num_samples=2)})
    first = small["synthetic-heldout"]
    assert first.num_samples == 2
    assert [t.task_id for t in first.tasks] == [
        t.task_id for t in suites["synthetic-heldout"].tasks[:5]
    ]


def test_multifile_heldout_is_the_familys_heldout_split_and_watched_only_when_asked() -> None:
    suites = load_suites({})
    multifile = suites["multifile-heldout"]
    assert not multifile.enabled and multifile.num_samples == 2
    assert all(suites[name].enabled for name in suites if name != "multifile-heldout")
    family = MultiFileFamily(seed=0, num_train=0, num_heldout=100)
    assert [t.SerializeToString() for t in multifile.tasks] == [
        t.SerializeToString() for t in family.tasks("heldout")
    ]
    assert {(t.family, t.split) for t in multifile.tasks} == {("multifile", "heldout")}
    asked = load_suites({"multifile-heldout": SuiteConfig(enabled=True, num_tasks=4)})
    assert asked["multifile-heldout"].enabled and len(asked["multifile-heldout"].tasks) == 4
    # An entry that only sets sizes keeps a suite's own default.
    assert load_suites({"humaneval": SuiteConfig(num_tasks=3)})["humaneval"].enabled
    assert not load_suites({"humaneval": SuiteConfig(enabled=False)})["humaneval"].enabled


def test_unknown_or_oversized_suites_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown suites behaviour; known suites: humaneval"):
        load_suites({"behaviour": SuiteConfig()})
    with pytest.raises(ValueError, match="humaneval has 164 tasks"):
        _ = load_suites({"humaneval": SuiteConfig(num_tasks=165)})["humaneval"].tasks
    with pytest.raises(ValueError, match="pass_at_k"):
        EvalsConfig.model_validate({"pass_at_k": [0, 2]})
    assert EvalsConfig.model_validate({"pass_at_k": [4, 1, 4]}).pass_at_k == [1, 4]
