"""The mixed feed: several generators interleaved by weight (services.reconciler.feeders)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.api.v1 import common_pb2
from services.config.reconciler import FeederConfig, MixSource
from services.reconciler.feeders import MixTaskFeeder, build_feeder, mix_schedule


def letters_task(position: int, seed: int) -> common_pb2.Task | None:
    """A source that never ends."""
    return _task("letters", position, seed)


def numbers_task(position: int, seed: int) -> common_pb2.Task | None:
    """A source of 3 tasks."""
    return _task("numbers", position, seed) if position < 3 else None


def _task(family: str, position: int, seed: int) -> common_pb2.Task:
    return common_pb2.Task(
        task_id=f"{family}/train/{seed}-{position}",
        family=family,
        split="train",
        instruction=f"task {position}",
        grading=common_pb2.GradingSpec(command=["true"], timeout_s=5),
    )


def mix_config(*sources: tuple[str, int], seed: int = 0) -> FeederConfig:
    return FeederConfig(
        kind="mix",
        mix=[MixSource(generator=f"tests.test_feeder_mix:{g}", weight=w) for g, w in sources],
        seed=seed,
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(1, 200))
def test_each_source_keeps_its_order_and_its_share(weights: list[int], length: int) -> None:
    cycle = mix_schedule(weights)
    total = sum(weights)
    assert Counter(source for source, _ in cycle) == dict(enumerate(weights))
    feeder = MixTaskFeeder.__new__(MixTaskFeeder)
    feeder._cycle, feeder._weights = cycle, weights
    seen: dict[int, list[int]] = {i: [] for i in range(len(weights))}
    for position in range(length):
        source, at = feeder.source_of(position)
        seen[source].append(at)
        # Spread, not bunched: every prefix is within one task of each source's share.
        for index, weight in enumerate(weights):
            assert abs(len(seen[index]) - (position + 1) * weight / total) < 1 + 1e-9
    for at in seen.values():
        assert at == list(range(len(at)))  # none skipped, none repeated


def test_the_mix_interleaves_its_generators_and_ends_with_the_first_to_end() -> None:
    feeder = build_feeder(mix_config(("letters_task", 2), ("numbers_task", 1), seed=4))
    ids = [task.task_id for task in feeder.tasks_from(0, 100)]
    assert ids == [
        "letters/train/4-0",
        "numbers/train/4-0",
        "letters/train/4-1",
        "letters/train/4-2",
        "numbers/train/4-1",
        "letters/train/4-3",
        "letters/train/4-4",
        "numbers/train/4-2",
        "letters/train/4-5",
        "letters/train/4-6",
    ]
    # From any cursor, the same tasks as from the start.
    assert [task.task_id for task in feeder.tasks_from(3, 4)] == ids[3:7]


def test_mix_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="kind 'mix' needs mix"):
        FeederConfig(kind="mix")
    with pytest.raises(ValueError, match="only it takes one"):
        FeederConfig(
            kind="generator",
            generator="tests.test_feeder_mix:letters_task",
            mix=[MixSource(generator="tests.test_feeder_mix:letters_task")],
        )
    with pytest.raises(ValueError, match="names a generator twice"):
        mix_config(("letters_task", 1), ("letters_task", 2))
    with pytest.raises(ValueError, match="weight"):
        MixSource(generator="tests.test_feeder_mix:letters_task", weight=0)
