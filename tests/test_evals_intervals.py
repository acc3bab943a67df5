"""95 % intervals of pass@1 and of a gain (bootstrap over tasks), in records and the report.

Datasets are drawn from known populations (task pass rates from a beta distribution, K
Bernoulli samples per task), so the intervals can be checked against the truth: they
cover the population's pass@1 about 95 % of the time, shrink as 1/sqrt(tasks), and a
gain on the same tasks is narrower paired than as two separate means.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from services.evals.intervals import (
    difference_interval,
    gain_interval,
    mean_interval,
    task_pass_rates,
)
from services.evals.record import EvalRecord, Interval
from services.evals.report import render
from services.evals.scoring import score
from services.launcher.summary import RunSummary, SuiteScores
from tests.test_evals_scoring import group, rollout


def draw_eval(rng: np.random.Generator, rates: np.ndarray, num_samples: int) -> dict[str, float]:
    """{task: fraction correct of `num_samples` samples} for tasks of pass rate `rates`."""
    correct = rng.binomial(num_samples, rates)
    return {f"t{i}": c / num_samples for i, c in enumerate(correct)}


def test_known_datasets() -> None:
    assert mean_interval([0.25] * 10) == Interval(low=0.25, high=0.25)
    assert mean_interval([1.0]) == Interval(low=1.0, high=1.0)
    data = [0.0] * 30 + [0.5] * 10 + [1.0] * 8
    interval = mean_interval(data)
    assert interval == mean_interval(list(data))  # a fixed seed: the same answer each time
    assert interval.low < np.mean(data) < interval.high
    # The normal approximation, mean +- 1.96 s / sqrt(n), on a set this size.
    half = 1.96 * np.std(data) / np.sqrt(len(data))
    assert interval.half_width == pytest.approx(half, rel=0.1)
    assert (round(interval.low, 4), round(interval.high, 4)) == (0.1667, 0.375)
    with pytest.raises(ValueError, match="at least one task"):
        mean_interval([])


def test_the_interval_covers_the_population_pass_at_1() -> None:
    rng = np.random.default_rng(7)
    covered = 0
    trials = 200
    for _ in range(trials):
        rates = rng.beta(0.4, 2.0, size=48)  # mostly hard tasks, a few easy: 0.17 mean
        interval = mean_interval(list(draw_eval(rng, rates, 4).values()))
        covered += interval.low <= 0.4 / 2.4 <= interval.high
    assert 0.9 <= covered / trials <= 0.99


def test_four_times_the_tasks_halves_the_interval() -> None:
    rng = np.random.default_rng(1)
    widths = {}
    for num_tasks in (48, 192):
        halves = [
            mean_interval(
                list(draw_eval(rng, rng.beta(0.4, 2.0, num_tasks), 4).values())
            ).half_width
            for _ in range(40)
        ]
        widths[num_tasks] = float(np.mean(halves))
    assert widths[192] / widths[48] == pytest.approx(0.5, abs=0.06)


def test_a_gain_on_the_same_tasks_is_paired() -> None:
    rng = np.random.default_rng(3)
    rates = rng.beta(0.4, 2.0, size=48)
    first = draw_eval(rng, rates, 4)
    last = draw_eval(rng, np.minimum(rates * 1.5, 1.0), 4)
    paired = difference_interval(first, last)
    gain = np.mean(list(last.values())) - np.mean(list(first.values()))
    assert paired.low < gain < paired.high
    # The same numbers as two unrelated sets of tasks: the difficulty no longer cancels.
    apart = difference_interval(first, {f"other-{t}": v for t, v in last.items()})
    assert paired.half_width < 0.8 * apart.half_width
    assert difference_interval(first, first) == Interval(low=0.0, high=0.0)
    # Version 0 on more tasks (a superset): its own tasks count too.
    wider = {**draw_eval(rng, rng.beta(0.4, 2.0, size=144), 4), **first}
    mixed = difference_interval({f"b{t}": v for t, v in wider.items()}, last)
    assert mixed.half_width < apart.half_width


def record_of(
    version: int,
    correct: dict[str, list[bool]],
    num_retried: int = 0,
    left_out_by: dict[str, int] | None = None,
) -> EvalRecord:
    groups = [
        group(
            task,
            [
                rollout(task, 1.0 if ok else 0.0, passed=ok, versions=(version, version))
                for ok in samples
            ],
        )
        for task, samples in correct.items()
    ]
    return score(
        run="r",
        suite="s",
        family="synthetic",
        version=version,
        num_samples=max(len(s) for s in correct.values()),
        ks=[1, 2],
        groups=groups,
        dropped_tasks=[],
        is_correct=lambda r: r.grade.all_passed,
        started_at=0.0,
        finished_at=1.0,
        num_retried=num_retried,
        left_out_by=left_out_by,
    )


def test_records_carry_the_interval_and_the_gain_has_one() -> None:
    base = record_of(0, {f"t{i}": [i % 3 == 0, False, False, i % 2 == 0] for i in range(12)})
    later = record_of(
        5,
        {f"t{i}": [i % 3 == 0, i % 2 == 0] for i in range(6)},
        num_retried=4,
        left_out_by={"v6": 2, "v5-v6": 1},
    )
    assert base.pass_at_1_interval is not None and later.pass_at_1_interval is not None
    assert base.pass_at_1_interval == mean_interval(list(task_pass_rates(base).values()))
    assert base.pass_at_1_interval.low <= base.pass_at_1 <= base.pass_at_1_interval.high
    assert (later.num_retried, later.num_left_out) == (4, 3)
    gain = gain_interval(base, later)
    assert gain.low < later.pass_at_1 - base.pass_at_1 < gain.high
    stored = EvalRecord.model_validate_json(later.model_dump_json())
    assert stored.pass_at_1_interval == later.pass_at_1_interval
    # A record written before intervals still loads.
    old = later.model_dump(mode="json", exclude={"pass_at_1_interval", "num_retried"})
    assert EvalRecord.model_validate(old | {"format": 1}).pass_at_1_interval is None


def test_the_report_shows_intervals_gains_and_retries() -> None:
    base = record_of(0, {f"t{i}": [i % 3 == 0, False] for i in range(6)})
    later = record_of(
        5, {f"t{i}": [i % 2 == 0, True] for i in range(6)}, num_retried=4, left_out_by={"v6": 2}
    )
    files = render("r", {"s": [base, later]})
    page = files["index.html"].decode()
    assert later.pass_at_1_interval is not None
    low, high = later.pass_at_1_interval.low, later.pass_at_1_interval.high
    assert f"{later.pass_at_1:.3f} [{low:.3f}, {high:.3f}]" in page
    gain = gain_interval(base, later)
    points = 100 * (later.pass_at_1 - base.pass_at_1)
    assert (
        f"pass@1 gain v0 -&gt; v5: {points:+.1f} points "
        f"[{100 * gain.low:+.1f}, {100 * gain.high:+.1f}]" in page
    )
    header = re.search(r"<thead><tr>(.*?)</tr></thead>", page)
    assert header is not None and "<th>retried</th><th>left out</th>" in header.group(1)
    assert "<td>4</td><td>2 (v6 2)</td>" in page
    assert files["pass_at_1.png"].startswith(b"\x89PNG")


def summary_of(scores: SuiteScores) -> RunSummary:
    """A run summary of nothing but `scores` (one suite's)."""
    return RunSummary(
        run="r", steps=0, groups_trained=0, rollouts_trained=0, groups_trained_twice=0,
        versions_published=[], versions_served=0, rollouts_spanning_versions=0, staleness={},
        reward_curve=[], suites=[scores], weight_sync_bytes_ratio=None,
        weight_versions_delta=0, update_pauses=0, mean_update_pause_s=None,
        trainer_wait_fraction=None, seconds_per_step=None,
    )  # fmt: skip


def test_the_run_summary_states_each_pass_at_1_and_the_gain_with_intervals() -> None:
    """`etude run`'s table and summary.json: both ends' intervals, the gain's (paired),
    each end's tasks x samples, and the generations retried and left out."""
    import io

    from rich.console import Console

    from services.launcher.summary import print_summary, suite_scores

    base = record_of(0, {f"t{i}": [i % 3 == 0, False, False, i % 2 == 0] for i in range(12)})
    later = record_of(
        5, {f"t{i}": [True, i % 2 == 0] for i in range(6)}, num_retried=4, left_out_by={"v6": 2}
    )
    (scores,) = suite_scores({"s": {0: base, 5: later}})
    gain = gain_interval(base, later)
    assert scores.gain_interval == (gain.low, gain.high)
    assert base.pass_at_1_interval is not None
    assert scores.first_interval == (base.pass_at_1_interval.low, base.pass_at_1_interval.high)
    assert (scores.first_num_tasks, scores.num_tasks) == (12, 6)
    assert (scores.num_retried, scores.num_left_out) == (4, 2)
    assert suite_scores({"s": {0: base}})[0].gain_interval is None  # one version: no gain

    summary = summary_of(scores)
    out = io.StringIO()
    print_summary(Console(file=out, width=300), summary, None)
    text = out.getvalue()
    points = f"{100 * gain.low:+.1f}, {100 * gain.high:+.1f}"
    assert f"points [{points}], 95 % over tasks; v0 12 tasks x 4, v5 6 tasks x 2" in text
    assert "4 / 2 (each score uses only its own version's samples)" in text


def test_a_kept_version_0_is_named_in_the_report_and_the_summary() -> None:
    import io

    from rich.console import Console

    from services.launcher.summary import print_summary, suite_scores

    base = record_of(0, {f"t{i}": [i % 3 == 0, False] for i in range(6)})
    kept = base.model_copy(update={"run": "r", "reused_from": "seed-0"})
    later = record_of(5, {f"t{i}": [True, i % 2 == 0] for i in range(6)})
    page = render("r", {"s": [kept, later]})["index.html"].decode()
    assert "<td>v0 (in run seed-0)</td>" in page and "<td>v5</td>" in page
    (scores,) = suite_scores({"s": {0: kept, 5: later}})
    assert scores.first_reused_from == "seed-0"
    summary = summary_of(scores)
    out = io.StringIO()
    print_summary(Console(file=out, width=300), summary, None)
    assert "v0 6 tasks x 2, scored in run seed-0, v5 6 tasks x 2" in out.getvalue()
    assert '"first_reused_from": "seed-0"' in summary.to_json()


def test_the_summary_shows_task_reward_and_summaries_where_rollouts_summarized() -> None:
    """Where pass@1 is near 0 (multifile-heldout), the summary says how far the policy got
    (mean task reward) and how often it summarized, at both ends."""
    import io

    from rich.console import Console

    from services.launcher.summary import print_summary, suite_scores

    base = record_of(0, {f"t{i}": [i == 0, False] for i in range(6)})
    later = record_of(5, {f"t{i}": [i < 3, False] for i in range(6)})
    unsummarized = {
        v: r.model_copy(update={"mean_summaries": 0.0}) for v, r in ((0, base), (5, later))
    }
    (plain,) = suite_scores({"s": unsummarized})
    assert (plain.first_task_reward, plain.last_task_reward) == pytest.approx((1 / 12, 3 / 12))
    out = io.StringIO()
    print_summary(Console(file=out, width=300), summary_of(plain), None)
    assert "s task reward" not in out.getvalue()  # no rollout summarized: pass@1 says it

    summarized = {
        0: base.model_copy(update={"mean_summaries": 0.5}),
        5: later.model_copy(update={"mean_summaries": 1.25}),
    }
    (scores,) = suite_scores({"s": summarized})
    assert (scores.first_summaries, scores.last_summaries) == (0.5, 1.25)
    out = io.StringIO()
    print_summary(Console(file=out, width=300), summary_of(scores), None)
    assert "v0 0.083 -> v5 0.250 (summaries a rollout 0.50 -> 1.25)" in out.getvalue()
    assert '"last_task_reward": 0.25' in summary_of(scores).to_json()
