"""`etude bench e2e`'s async_efficiency: the async speedup over the ideal one, from the
sync run's own step records."""

from __future__ import annotations

import pytest

from services.bench.e2e import async_efficiency, ideal_speedup


def _sync_records(waits: list[float], step_seconds: float) -> list[dict[str, float]]:
    return [
        {"step": step + 1, "time": 100.0 + step * step_seconds, "time_wait_s": wait}
        for step, wait in enumerate(waits)
    ]


def test_generation_bound_run() -> None:
    # 10 s a step, 6 of them waiting for generation (the first step's wait is not counted,
    # as seconds_per_step does not count the first step): overlap could give 10 / 6.
    records = _sync_records([50.0, 6.0, 6.0, 6.0], step_seconds=10.0)
    generation, training, ideal = ideal_speedup(list(reversed(records)))
    assert generation == pytest.approx(6.0)
    assert training == pytest.approx(4.0)
    assert ideal == pytest.approx(10.0 / 6.0)
    # An async run 1.5x faster than sync got 0.9 of that.
    assert async_efficiency(1.5, ideal) == pytest.approx(0.9)


def test_training_bound_run_and_perfect_balance() -> None:
    generation, training, ideal = ideal_speedup(_sync_records([0.0, 2.0, 3.0], 10.0))
    assert (generation, training) == (pytest.approx(2.5), pytest.approx(7.5))
    assert ideal == pytest.approx(10.0 / 7.5)
    # Generation and training equal: the ideal is 2 (each hides the other entirely).
    assert ideal_speedup(_sync_records([0.0, 5.0], 10.0))[2] == pytest.approx(2.0)
    assert async_efficiency(1.7, 2.0) == pytest.approx(0.85)


def test_too_few_steps_and_no_ideal() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        ideal_speedup(_sync_records([1.0], 10.0))
    assert async_efficiency(1.5, 0.0) == 0.0
