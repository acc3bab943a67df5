"""95 % intervals of pass@1 and of a gain, by bootstrap over tasks.

pass@1 of an eval is the mean over its tasks of each task's fraction of correct samples
(c/n). Its interval resamples the *tasks* with replacement, each keeping its own mean
over samples, and takes the 2.5th and 97.5th percentiles of the resampled means
(percentile bootstrap, ``NUM_RESAMPLES`` draws, a fixed seed: the same record always
gets the same interval). It answers "how much would this pass@1 move on another draw of
tasks like these", which has two parts:

* the spread of difficulty between tasks (some tasks are easy, most are hard); more
  samples per task do not shrink it, only more tasks do (half-width ~ 1/sqrt(tasks));
* each task's sampling noise, p(1-p)/n for n samples; more samples shrink it.

Re-running one eval on the same tasks moves pass@1 by the second part only, and so does
a gain measured on the same tasks: the difference of two versions' means on one task
cancels that task's difficulty. ``gain_interval`` therefore resamples the tasks both
versions were scored on *together* (paired), and a task only one of them has on its own
(so a version 0 scored on more tasks of the suite than later versions still counts
them all); the gain is the difference of the two pass@1 as recorded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from services.evals.record import EvalRecord, Interval

CONFIDENCE = 0.95
NUM_RESAMPLES = 2000
SEED = 0


def _percentiles(values: np.ndarray) -> Interval:
    tail = 100.0 * (1.0 - CONFIDENCE) / 2.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return Interval(low=float(low), high=float(high))


def _resampled_sums(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sum of `values` resampled with replacement, once per draw (zeros when empty)."""
    if values.size == 0:
        return np.zeros(NUM_RESAMPLES)
    picks = rng.integers(0, values.size, size=(NUM_RESAMPLES, values.size))
    sums: np.ndarray = values[picks].sum(axis=1)
    return sums


def mean_interval(task_means: Sequence[float]) -> Interval:
    """95 % bootstrap interval of the mean of `task_means` (tasks resampled)."""
    if not task_means:
        raise ValueError("an interval needs at least one task")
    values = np.asarray(task_means, dtype=np.float64)
    rng = np.random.default_rng(SEED)
    return _percentiles(_resampled_sums(values, rng) / values.size)


def task_pass_rates(record: EvalRecord) -> dict[str, float]:
    """{task id: fraction of its samples that were correct} of the record's scored tasks."""
    return {t.task_id: t.num_correct / t.num_samples for t in record.tasks if t.num_samples}


def difference_interval(first: Mapping[str, float], last: Mapping[str, float]) -> Interval:
    """95 % bootstrap interval of mean(last) - mean(first), two {task: value} tables.

    Tasks in both tables are drawn together (paired); tasks in one table only are drawn
    from that table's own tasks, in the same proportion as in its mean.
    """
    if not first or not last:
        raise ValueError("a difference needs at least one task on each side")
    common = sorted(set(first) & set(last))
    only_first = np.asarray([v for t, v in first.items() if t not in last], dtype=np.float64)
    only_last = np.asarray([v for t, v in last.items() if t not in first], dtype=np.float64)
    rng = np.random.default_rng(SEED)
    if common:
        picks = rng.integers(0, len(common), size=(NUM_RESAMPLES, len(common)))
        common_first = np.asarray([first[t] for t in common])[picks].sum(axis=1)
        common_last = np.asarray([last[t] for t in common])[picks].sum(axis=1)
    else:
        common_first = common_last = np.zeros(NUM_RESAMPLES)
    mean_first = (common_first + _resampled_sums(only_first, rng)) / len(first)
    mean_last = (common_last + _resampled_sums(only_last, rng)) / len(last)
    return _percentiles(mean_last - mean_first)


def gain_interval(first: EvalRecord, last: EvalRecord) -> Interval:
    """95 % interval of ``last.pass_at_1 - first.pass_at_1`` (same suite), paired over the
    tasks both were scored on."""
    if first.suite != last.suite:
        raise ValueError(f"a gain compares one suite, got {first.suite} and {last.suite}")
    return difference_interval(task_pass_rates(first), task_pass_rates(last))
