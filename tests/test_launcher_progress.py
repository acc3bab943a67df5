"""`etude run` without a terminal: one plain line per RL step, each printed once."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from services.config.deployment import load_config
from services.launcher.observe import step_lines
from services.launcher.run import LocalRun, _training_view

REPO = Path(__file__).resolve().parent.parent


def _record(step: int, time: float, reward: float) -> dict[str, object]:
    return {
        "step": step,
        "version": step,
        "time": time,
        "reward_total_mean": reward,
        "staleness_mean": 0.5,
        "time_wait_s": 1.0,
        "time_compute_s": 2.5,
    }


def test_a_line_per_new_step_with_its_seconds_since_the_last() -> None:
    steps = [_record(1, 100.0, 0.25), _record(2, 110.5, 0.5), _record(3, 118.0, 0.75)]
    assert step_lines(steps, after=0, max_steps=30) == [
        "step 1/30: version 1, reward 0.250, staleness 0.50, 3.5 s",
        "step 2/30: version 2, reward 0.500, staleness 0.50, 10.5 s",
        "step 3/30: version 3, reward 0.750, staleness 0.50, 7.5 s",
    ]
    assert step_lines(steps, after=2, max_steps=30) == [
        "step 3/30: version 3, reward 0.750, staleness 0.50, 7.5 s"
    ]
    assert step_lines(steps, after=3, max_steps=30) == []


def test_the_training_view_prints_each_step_once_when_piped(tmp_path: Path) -> None:
    config = load_config(
        REPO / "configs" / "local.toml",
        {
            "ETUDE_RUN__STATE_DIR": str(tmp_path),
            "ETUDE_OBJECT_STORE__URL": f"file://{tmp_path}/store",
            "ETUDE_TRAINER__JOB__METRICS_FILE": str(tmp_path / "steps.jsonl"),
        },
    )
    assert config.trainer.job is not None and config.trainer.job.metrics_file is not None
    out = io.StringIO()
    run = LocalRun(config, None, Console(file=out, force_terminal=False, width=200))
    records = config.trainer.job.metrics_file
    records.write_text(json.dumps(_record(1, 100.0, 0.25)) + "\n")
    _training_view(run)
    with records.open("a") as handle:
        handle.write(json.dumps(_record(2, 104.0, 0.5)) + "\n")
    _training_view(run)
    _training_view(run)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    max_steps = config.trainer.job.max_steps
    assert lines == [
        f"step 1/{max_steps}: version 1, reward 0.250, staleness 0.50, 3.5 s",
        f"step 2/{max_steps}: version 2, reward 0.500, staleness 0.50, 4.0 s",
    ]
