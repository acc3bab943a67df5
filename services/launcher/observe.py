"""What a local run is doing, read from where the services already report it.

The launcher adds no reporting channel of its own: the trainer's per-step records
(``trainer.job.metrics_file``, JSON lines), the eval results in the object store, and the
services' Prometheus endpoints are the sources. ``snapshot`` reads them all; ``view``
renders one snapshot as the live terminal panel of ``etude run``.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group as RenderGroup
from rich.table import Table

from services.config.deployment import EtudeConfig
from services.evals.record import EvalRecord
from services.evals.results import discover, read_record
from services.objectstore.base import ObjectStore


def read_steps(path: Path | None) -> list[dict[str, Any]]:
    """The trainer's step records, oldest first (a torn last line is ignored).

    A restarted trainer retrains the steps after its last checkpoint and appends their
    records again; the newest record of each step wins.
    """
    if path is None or not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def read_evals(
    store: ObjectStore, run: str, known: dict[str, EvalRecord] | None = None
) -> dict[str, dict[int, EvalRecord]]:
    """{suite: {version: record}} of every stored eval of ``run``.

    ``known`` ({key: record}) is filled and reused: a (suite, version) is evaluated once,
    so its record never changes, and the live view reads each one once, not every second.
    """
    known = {} if known is None else known
    found: dict[str, dict[int, EvalRecord]] = {}
    for suite, versions in discover(store, run).items():
        for version, key in versions.items():
            if key not in known:
                try:
                    known[key] = read_record(store, key)[0]
                except Exception:  # written while read; the next snapshot sees it whole
                    continue
            found.setdefault(suite, {})[version] = known[key]
    return found


def scrape(port: int, timeout_s: float = 1.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{sample name: [(labels, value)]} from a service's /metrics; empty when it is down."""
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError:
        return {}
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def by_label(
    samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str, label: str
) -> dict[str, float]:
    """{label value: sample value} of one metric."""
    return {labels.get(label, ""): value for labels, value in samples.get(name, [])}


def single(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    """The value of an unlabelled sample, or None."""
    values = samples.get(name)
    return values[0][1] if values else None


@dataclass
class Snapshot:
    """One look at the run."""

    taken_at: float
    steps: list[dict[str, Any]]
    evals: dict[str, dict[int, EvalRecord]]
    groups_by_state: dict[str, float] = field(default_factory=dict)
    training_groups_by_state: dict[str, float] = field(default_factory=dict)
    slots_by_state: dict[str, float] = field(default_factory=dict)
    serving_version: float | None = None
    update_pauses: int = 0
    last_update_pause_s: float | None = None
    generated_tokens: float | None = None

    @property
    def last(self) -> dict[str, Any]:
        """The newest step record (empty before the first step)."""
        return self.steps[-1] if self.steps else {}


def snapshot(
    config: EtudeConfig, store: ObjectStore, known_evals: dict[str, EvalRecord] | None = None
) -> Snapshot:
    """Reads every source once (eval records already in ``known_evals`` are not re-read)."""
    job = config.trainer.job
    shot = Snapshot(
        taken_at=time.time(),
        steps=read_steps(job.metrics_file if job is not None else None),
        evals=read_evals(store, config.run.name, known_evals),
    )
    reconciler = scrape(config.reconciler.http.port)
    shot.groups_by_state = by_label(reconciler, "etude_reconciler_groups", "state")
    shot.training_groups_by_state = by_label(
        reconciler, "etude_reconciler_training_groups", "state"
    )
    shot.slots_by_state = by_label(reconciler, "etude_reconciler_slots", "state")
    inference = scrape(config.inference.http.port)
    shot.serving_version = single(inference, "etude_inference_serving_version")
    shot.generated_tokens = single(inference, "etude_inference_generated_tokens_total")
    pauses = single(inference, "etude_inference_update_pause_seconds_count")
    total = single(inference, "etude_inference_update_pause_seconds_sum")
    if pauses:
        shot.update_pauses = int(pauses)
        shot.last_update_pause_s = (total or 0.0) / pauses  # the mean: the histogram's best
    return shot


def step_lines(steps: list[dict[str, Any]], after: int, max_steps: int) -> list[str]:
    """One plain line for each step record newer than step ``after``: what ``etude run``
    prints when its console is not a terminal, where the live panel draws nothing until
    it stops. Seconds are the wall time since the previous record (the first record's
    own wait and compute time)."""
    lines = []
    for previous, record in itertools.pairwise([{}, *steps]):
        if record["step"] <= after:
            continue
        if "time" in previous and "time" in record:
            seconds = record["time"] - previous["time"]
        else:
            seconds = record.get("time_wait_s", 0.0) + record.get("time_compute_s", 0.0)
        lines.append(
            f"step {record['step']}/{max_steps or '-'}: version {_fmt(record.get('version'))}, "
            f"reward {_fmt(record.get('reward_total_mean'))}, "
            f"staleness {_fmt(record.get('staleness_mean'), 2)}, {seconds:.1f} s"
        )
    return lines


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _reward_parts(record: Mapping[str, Any]) -> str:
    parts = sorted(k for k in record if k.startswith("reward_") and k.endswith("_mean"))
    return "  ".join(
        f"{k.removeprefix('reward_').removesuffix('_mean')} {record[k]:+.3f}" for k in parts
    )


def _eval_rows(evals: Mapping[str, Mapping[int, EvalRecord]]) -> Iterable[list[str]]:
    for suite in sorted(evals):
        versions = evals[suite]
        cells = [f"v{v}: {versions[v].pass_at_1:.2f}" for v in sorted(versions)[-6:]]
        yield [suite, "  ".join(cells)]


def view(shot: Snapshot, phase: str, services: Table, max_steps: int) -> RenderGroup:
    """The live panel: services, training, evals."""
    last = shot.last
    training = Table(title=f"training ({phase})", show_header=False, expand=False)
    training.add_column("what", style="bold")
    training.add_column("value")
    step = last.get("step")
    training.add_row("step", f"{_fmt(step)} / {max_steps or '-'}")
    training.add_row("policy version", _fmt(last.get("version")))
    training.add_row("serving version", _fmt(shot.serving_version and int(shot.serving_version)))
    training.add_row("mean reward", _fmt(last.get("reward_total_mean")))
    training.add_row("reward parts", _reward_parts(last) or "-")
    training.add_row("staleness (mean)", _fmt(last.get("staleness_mean"), 2))
    training.add_row("tokens/s (trainer)", _fmt(last.get("tokens_per_s"), 0))
    training_groups = shot.training_groups_by_state
    groups = "  ".join(f"{k.lower()} {int(v)}" for k, v in sorted(training_groups.items()) if v)
    training.add_row("training groups", groups or "-")
    # Eval groups in flight (a finished one stays READY: its result is kept, not consumed).
    running = shot.groups_by_state.get("RUNNING", 0) - training_groups.get("RUNNING", 0)
    training.add_row("eval groups running", str(int(running)))
    pause = shot.last_update_pause_s
    training.add_row(
        "weight updates", f"{shot.update_pauses} (mean pause {_fmt(pause, 2)} s)" if pause else "0"
    )
    evals = Table(title="held-out pass@1 by version", show_header=False, expand=False)
    evals.add_column("suite", style="bold")
    evals.add_column("pass@1")
    for row in _eval_rows(shot.evals):
        evals.add_row(*row)
    return RenderGroup(services, training, evals)
