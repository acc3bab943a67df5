"""The end of a local run: what it trained, how it went, and the report.

``summarize`` turns the trainer's step records, the eval results and the published
manifests into one ``RunSummary`` (also ``summary.json``); ``write_report`` writes the
evals report (HTML + a PNG per metric) with the run's own plots beside it (reward curve,
staleness histogram, trained tokens and importance ratio by version lag) into
``<state_dir>/report``; ``print_summary`` shows it.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from rich.console import Console
from rich.table import Table

from services.api.v1 import common_pb2
from services.evals.intervals import gain_interval
from services.evals.record import EvalRecord
from services.evals.report import render
from services.launcher.observe import Snapshot
from services.objectstore.base import ObjectStore
from services.trainer.metrics import LAG_BUCKETS
from services.weights.manifest import Layout, Manifest


@dataclass
class SuiteScores:
    """pass@1 of one suite at the first and last evaluated versions."""

    suite: str
    first_version: int
    first_pass_at_1: float
    last_version: int
    last_pass_at_1: float
    num_tasks: int
    num_samples: int
    # 95 % intervals (bootstrap over tasks; None for records from before they were kept):
    # of each pass@1, and of the gain (paired over the tasks both versions were scored on).
    first_interval: tuple[float, float] | None = None
    last_interval: tuple[float, float] | None = None
    gain_interval: tuple[float, float] | None = None
    first_num_tasks: int = 0
    first_num_samples: int = 0
    # Generations asked again (made partly by an older version) and left out (by a newer
    # one) over all the suite's evals: each score uses only its own version's samples.
    num_retried: int = 0
    num_left_out: int = 0
    # The run whose score of version 0 (same base model, tasks and settings) this run took
    # instead of sampling it again; None when this run sampled it.
    first_reused_from: str | None = None
    # Mean task reward (the fraction of a task's tests passed) and summaries per rollout
    # at each end: how far a policy gets where pass@1 is near 0 (multifile-heldout).
    first_task_reward: float = 0.0
    last_task_reward: float = 0.0
    first_summaries: float = 0.0
    last_summaries: float = 0.0

    @property
    def gain_points(self) -> float:
        """Last minus first, in percentage points."""
        return 100.0 * (self.last_pass_at_1 - self.first_pass_at_1)


@dataclass
class RecordFigures:
    """What the run's stored rollout records show."""

    # Routed-expert bytes the stored rollouts carry: mean per rollout and per token (each
    # row once, so linear in a rollout's tokens; None without records or routing).
    routing_bytes_per_rollout: float | None = None
    routing_bytes_per_token: float | None = None
    # Trained rollouts (of the trained groups) that summarized at least once, of those with
    # a record, and the mean task reward of each side (None for a side with none).
    rollouts_summarized: int = 0
    rollouts_with_records: int = 0
    task_reward_summarized: float | None = None
    task_reward_unsummarized: float | None = None


@dataclass(kw_only=True)
class RunSummary(RecordFigures):
    """What ``etude run`` prints and writes as ``summary.json`` (with what the stored
    rollout records show)."""

    run: str
    steps: int
    groups_trained: int
    rollouts_trained: int
    groups_trained_twice: int
    versions_published: list[int]
    versions_served: int
    rollouts_spanning_versions: int
    staleness: dict[int, int]
    reward_curve: list[tuple[int, float]]
    suites: list[SuiteScores]
    weight_sync_bytes_ratio: float | None
    weight_versions_delta: int
    update_pauses: int
    mean_update_pause_s: float | None
    trainer_wait_fraction: float | None
    seconds_per_step: float | None
    # Trained groups whose rollouts all earned the same task reward (no task signal), and
    # how many of them the trainer left out of the gradient (rl.skip_uniform_task_groups).
    groups_uniform_task_reward: int = 0
    groups_skipped_uniform: int = 0
    # Trained tokens by version lag (trainer version - generating version; LAG_BUCKETS, and
    # "unknown" when some had no version span), their mean importance ratio by lag
    # (token-weighted over the run, lags with tokens only), and the mean lag.
    tokens_by_lag: dict[str, int] = field(default_factory=dict)
    is_ratio_by_lag: dict[str, float] = field(default_factory=dict)
    version_lag_mean: float | None = None
    # Rollout attempts the infrastructure failed (retried, never trained) among those of
    # the trained groups: all steps' rate, the worst step's, and by the kind of each
    # slot's last fault (services.slot_faults).
    rollout_attempts: int = 0
    infra_faults: int = 0
    infra_fault_rate: float | None = None
    max_step_infra_fault_rate: float | None = None
    infra_faults_by_kind: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """The summary as indented JSON."""
        data = asdict(self)
        data["staleness"] = {str(k): v for k, v in self.staleness.items()}
        for suite, scores in zip(data["suites"], self.suites, strict=True):
            suite["gain_points"] = scores.gain_points
        return json.dumps(data, indent=2, sort_keys=True)


def manifests(store: ObjectStore, run: str) -> list[Manifest]:
    """Every published version's manifest, oldest first."""
    layout = Layout(run)
    found = []
    for key in store.list(layout.root + "/"):
        if layout.parse_version(key) is not None:
            found.append(Manifest.model_validate_json(store.get(key)))
    return sorted(found, key=lambda m: m.version)


def suite_scores(evals: Mapping[str, Mapping[int, EvalRecord]]) -> list[SuiteScores]:
    """First vs last evaluated version of each suite."""
    scores = []
    for suite in sorted(evals):
        versions = evals[suite]
        if not versions:
            continue
        first, last = versions[min(versions)], versions[max(versions)]
        gain = None
        if first is not last and first.pass_at_1_interval and last.pass_at_1_interval:
            interval = gain_interval(first, last)
            gain = (interval.low, interval.high)
        scores.append(
            SuiteScores(
                suite,
                first.policy_version,
                first.pass_at_1,
                last.policy_version,
                last.pass_at_1,
                last.num_tasks,
                last.num_samples,
                first_interval=_bounds(first),
                last_interval=_bounds(last),
                gain_interval=gain,
                first_num_tasks=first.num_tasks,
                first_num_samples=first.num_samples,
                num_retried=sum(r.num_retried for r in versions.values()),
                num_left_out=sum(r.num_left_out for r in versions.values()),
                first_reused_from=first.reused_from,
                first_task_reward=first.mean_reward.task,
                last_task_reward=last.mean_reward.task,
                first_summaries=first.mean_summaries,
                last_summaries=last.mean_summaries,
            )
        )
    return scores


def _bounds(record: EvalRecord) -> tuple[float, float] | None:
    interval = record.pass_at_1_interval
    return None if interval is None else (interval.low, interval.high)


def _bracket(bounds: tuple[float, float] | None, scale: float = 1.0, sign: str = "") -> str:
    if bounds is None:
        return ""
    digits = 1 if scale != 1.0 else 3
    low, high = (f"{scale * b:{sign}.{digits}f}" for b in bounds)
    return f" [{low}, {high}]"


def record_figures(store: ObjectStore, run: str, trained_groups: Set[str]) -> RecordFigures:
    """Routing bytes over every stored rollout record of ``run``; self-summaries and task
    rewards over those of `trained_groups`."""
    num_records = num_bytes = num_tokens = 0
    rewards: dict[bool, list[float]] = {True: [], False: []}
    for key in store.list(f"rollouts/{run}/"):
        try:
            record = common_pb2.RolloutRecord.FromString(store.get(key))
        except DecodeError:  # a damaged record is the trainer's to report, not the summary's
            continue
        num_records += 1
        num_bytes += sum(len(s.routed_experts.data) for s in record.segments)
        num_tokens += sum(len(s.token_ids) for s in record.segments)
        if record.summary.group_id in trained_groups:
            summarized = record.summary.stats.num_summaries > 0
            rewards[summarized].append(record.summary.reward.task)
    figures = RecordFigures(
        rollouts_summarized=len(rewards[True]),
        rollouts_with_records=len(rewards[True]) + len(rewards[False]),
        task_reward_summarized=_mean(rewards[True]),
        task_reward_unsummarized=_mean(rewards[False]),
    )
    if num_records and num_bytes:
        figures.routing_bytes_per_rollout = num_bytes / num_records
        figures.routing_bytes_per_token = num_bytes / max(num_tokens, 1)
    return figures


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def lag_figures(
    steps: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, int], dict[str, float], float | None]:
    """Trained tokens by version lag over the run's steps, their token-weighted mean
    importance ratio by lag, and the mean lag (empty and None without lag figures)."""
    records = [r for r in steps if "tokens_lag0" in r]  # older records have none
    if not records:
        return {}, {}, None
    tokens: Counter[str] = Counter()
    ratio_sums = dict.fromkeys(LAG_BUCKETS, 0.0)
    lag_sum = 0.0
    for record in records:
        for bucket in LAG_BUCKETS:
            count = float(record[f"tokens_lag{bucket}"])
            tokens[bucket] += int(count)
            ratio_sums[bucket] += count * float(record[f"is_ratio_mean_lag{bucket}"])
        tokens["unknown"] += int(record.get("tokens_lag_unknown", 0))
        known = sum(float(record[f"tokens_lag{bucket}"]) for bucket in LAG_BUCKETS)
        lag_sum += known * float(record.get("version_lag_mean", 0.0))
    by_lag = {bucket: tokens[bucket] for bucket in LAG_BUCKETS}
    if tokens["unknown"]:
        by_lag["unknown"] = tokens["unknown"]
    ratios = {b: ratio_sums[b] / tokens[b] for b in LAG_BUCKETS if tokens[b]}
    num_known = sum(tokens[bucket] for bucket in LAG_BUCKETS)
    return by_lag, ratios, lag_sum / num_known if num_known else None


def infra_fault_figures(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's infrastructure faults from the step records that count them."""
    records = [r for r in steps if "rollout_attempts" in r]  # older records have none
    attempts = sum(int(r["rollout_attempts"]) for r in records)
    faults = sum(int(r["infra_faults"]) for r in records)
    by_kind: Counter[str] = Counter()
    for record in records:
        by_kind.update({k: int(v) for k, v in record.get("infra_faults_by_kind", {}).items()})
    return {
        "rollout_attempts": attempts,
        "infra_faults": faults,
        "infra_fault_rate": faults / attempts if attempts else None,
        "max_step_infra_fault_rate": max(
            (float(r["infra_fault_rate"]) for r in records), default=None
        ),
        "infra_faults_by_kind": dict(sorted(by_kind.items())),
    }


def summarize(run: str, shot: Snapshot, store: ObjectStore) -> RunSummary:
    """The run's figures from one final snapshot and the store."""
    steps = shot.steps
    trained: Counter[str] = Counter(g for record in steps for g in record.get("group_ids", []))
    staleness: Counter[int] = Counter(s for record in steps for s in record.get("staleness", []))
    published = manifests(store, run)
    deltas = [m for m in published if not m.keyframe]
    ratio = (
        sum(m.stored_bytes for m in deltas) / sum(m.raw_bytes for m in deltas) if deltas else None
    )
    waits = sum(float(r.get("time_wait_s", 0.0)) for r in steps)
    computes = sum(float(r.get("time_compute_s", 0.0)) for r in steps)
    wall = [float(r["time"]) for r in steps if "time" in r]
    from_records = record_figures(store, run, set(trained))
    tokens_by_lag, is_ratio_by_lag, lag_mean = lag_figures(steps)
    return RunSummary(
        **asdict(from_records),
        run=run,
        steps=len(steps),
        groups_trained=len(trained),
        rollouts_trained=int(sum(float(r.get("rollouts", 0.0)) for r in steps)),
        groups_trained_twice=sum(1 for count in trained.values() if count > 1),
        # Retention may have removed old manifests: the trainer's records and the evals
        # (which score published versions only) remember them.
        versions_published=sorted(
            {m.version for m in published}
            | {int(r["version"]) for r in steps if "version" in r}
            | {v for versions in shot.evals.values() for v in versions}
        ),
        versions_served=len({int(v) for r in steps for v in r.get("rollout_versions", [])}),
        rollouts_spanning_versions=int(sum(r.get("rollouts_spanning_versions", 0) for r in steps)),
        staleness=dict(sorted(staleness.items())),
        reward_curve=[
            (int(r["step"]), float(r["reward_total_mean"]))
            for r in steps
            if "reward_total_mean" in r
        ],
        suites=suite_scores(shot.evals),
        weight_sync_bytes_ratio=ratio,
        weight_versions_delta=len(deltas),
        update_pauses=shot.update_pauses,
        mean_update_pause_s=shot.last_update_pause_s,
        trainer_wait_fraction=waits / (waits + computes) if waits + computes > 0 else None,
        seconds_per_step=(wall[-1] - wall[0]) / (len(wall) - 1) if len(wall) > 1 else None,
        groups_uniform_task_reward=int(
            sum(float(r.get("groups_uniform_task_reward", 0.0)) for r in steps)
        ),
        groups_skipped_uniform=int(
            sum(float(r.get("skipped_group_uniform_task_reward", 0.0)) for r in steps)
        ),
        tokens_by_lag=tokens_by_lag,
        is_ratio_by_lag=is_ratio_by_lag,
        version_lag_mean=lag_mean,
        **infra_fault_figures(steps),
    )


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def reward_plot(steps: Sequence[Mapping[str, Any]]) -> bytes:
    """Mean reward and its parts against step."""
    figure = Figure(figsize=(6.4, 3.4), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    names = sorted({k for r in steps for k in r if k.startswith("reward_") and k.endswith("_mean")})
    for name in names:
        points = [(r["step"], r[name]) for r in steps if name in r]
        label = name.removeprefix("reward_").removesuffix("_mean")
        axes.plot(*zip(*points, strict=True), label=label, linewidth=2 if label == "total" else 1)
    axes.set_title("training reward by part")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if names:
        axes.legend(fontsize="small")
    return _png(figure)


def staleness_plot(staleness: Mapping[int, int]) -> bytes:
    """How many policy versions old the trained groups were."""
    figure = Figure(figsize=(6.4, 3.0), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    axes.bar([str(k) for k in staleness], list(staleness.values()))
    axes.set_title("staleness of trained groups (policy versions)")
    axes.set_xlabel("versions behind the trainer when trained")
    axes.set_ylabel("groups")
    return _png(figure)


def offpolicy_plot(steps: Sequence[Mapping[str, Any]]) -> bytes:
    """Per step: the share of trained tokens of each version lag (stacked), and their mean
    importance ratio pi_train / pi_behaviour by lag."""
    figure = Figure(figsize=(6.4, 5.2), dpi=100, layout="constrained")
    shares, ratios = figure.subplots(2, 1, sharex=True)
    records = [r for r in steps if "tokens_lag0" in r]
    numbers = [int(r["step"]) for r in records]
    totals = [max(sum(float(r[f"tokens_lag{b}"]) for b in LAG_BUCKETS), 1.0) for r in records]
    bottom = [0.0] * len(records)
    for bucket in LAG_BUCKETS:
        share = [float(r[f"tokens_lag{bucket}"]) / t for r, t in zip(records, totals, strict=True)]
        shares.bar(numbers, share, bottom=bottom, label=f"lag {bucket}")
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
        points = [
            (n, r[f"is_ratio_mean_lag{bucket}"])
            for n, r in zip(numbers, records, strict=True)
            if r[f"tokens_lag{bucket}"]
        ]
        if points:
            ratios.plot(*zip(*points, strict=True), marker="o", markersize=3, label=f"lag {bucket}")
    shares.set_title("trained tokens by version lag (trainer version - generating version)")
    shares.set_ylabel("share of tokens")
    ratios.set_title("mean importance ratio pi_train / pi_behaviour by lag")
    ratios.axhline(1.0, color="grey", linewidth=0.8)
    ratios.set_xlabel("step")
    ratios.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axes in (shares, ratios):
        axes.grid(alpha=0.3)
    if records:
        shares.legend(fontsize="small")
        ratios.legend(fontsize="small")
    return _png(figure)


def write_report(
    out: Path, summary: RunSummary, shot: Snapshot, records: Mapping[str, Sequence[EvalRecord]]
) -> Path:
    """Writes the evals report, the run's plots and summary.json; returns index.html."""
    out.mkdir(parents=True, exist_ok=True)
    files = render(summary.run, records)
    files["reward.png"] = reward_plot(shot.steps)
    files["staleness.png"] = staleness_plot(summary.staleness)
    files["offpolicy.png"] = offpolicy_plot(shot.steps)
    files["summary.json"] = summary.to_json().encode()
    page = files["index.html"].decode()
    extra = (
        '<h2>Training</h2><p><img src="reward.png" alt="reward"> '
        '<img src="staleness.png" alt="staleness"> '
        '<img src="offpolicy.png" alt="trained tokens and importance ratio by version lag">'
        "</p>"
        '<p><a href="summary.json">summary.json</a></p>'
    )
    files["index.html"] = page.replace("</body>", extra + "</body>", 1).encode()
    for name, data in files.items():
        (out / name).write_bytes(data)
    return out / "index.html"


def _summarized(summary: RunSummary) -> str:
    """Trained rollouts that summarized, and their task reward against the others'."""
    share = summary.rollouts_summarized / summary.rollouts_with_records
    text = (
        f"{summary.rollouts_summarized} of {summary.rollouts_with_records} trained "
        f"({100 * share:.0f}%)"
    )
    with_, without = summary.task_reward_summarized, summary.task_reward_unsummarized
    if with_ is not None and without is not None:
        text += f"; task reward {with_:.3f} with a summary, {without:.3f} without"
    return text


def print_summary(console: Console, summary: RunSummary, report: Path | None) -> None:
    """The table at the end of ``etude run``."""
    table = Table(title=f"run {summary.run}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for scores in summary.suites:
        gain = f"{scores.gain_points:+.1f} points{_bracket(scores.gain_interval, 100, '+')}"
        if scores.gain_interval is not None:
            gain += ", 95 % over tasks"
        table.add_row(
            f"{scores.suite} pass@1",
            f"v{scores.first_version} {scores.first_pass_at_1:.3f}"
            f"{_bracket(scores.first_interval)} -> "
            f"v{scores.last_version} {scores.last_pass_at_1:.3f}{_bracket(scores.last_interval)} "
            f"({gain}; v{scores.first_version} {scores.first_num_tasks} tasks x "
            f"{scores.first_num_samples}"
            + (f", scored in run {scores.first_reused_from}" if scores.first_reused_from else "")
            + f", v{scores.last_version} {scores.num_tasks} tasks x {scores.num_samples})",
        )
    for scores in summary.suites:
        if scores.first_summaries or scores.last_summaries:
            table.add_row(
                f"{scores.suite} task reward",
                f"v{scores.first_version} {scores.first_task_reward:.3f} -> "
                f"v{scores.last_version} {scores.last_task_reward:.3f} (summaries a rollout "
                f"{scores.first_summaries:.2f} -> {scores.last_summaries:.2f})",
            )
    if summary.suites:
        table.add_row(
            "eval generations retried / left out",
            f"{sum(s.num_retried for s in summary.suites)} / "
            f"{sum(s.num_left_out for s in summary.suites)} (each score uses only its own "
            "version's samples)",
        )
    curve = summary.reward_curve
    if curve:
        table.add_row(
            "mean reward",
            f"step {curve[0][0]} {curve[0][1]:+.3f} -> step {curve[-1][0]} {curve[-1][1]:+.3f}",
        )
    table.add_row(
        "steps / groups trained",
        f"{summary.steps} / {summary.groups_trained} "
        f"({summary.rollouts_trained} rollouts, {summary.groups_trained_twice} twice)",
    )
    if summary.groups_uniform_task_reward:
        share = summary.groups_uniform_task_reward / max(summary.groups_trained, 1)
        table.add_row(
            "groups with one task reward",
            f"{summary.groups_uniform_task_reward} ({100 * share:.0f}%), "
            f"{summary.groups_skipped_uniform} left out of the gradient",
        )
    versions = summary.versions_published
    table.add_row(
        "versions published",
        f"{len(versions)} (v{versions[0]}..v{versions[-1]})" if versions else "0",
    )
    table.add_row("rollouts spanning versions", str(summary.rollouts_spanning_versions))
    table.add_row(
        "staleness (versions: groups)",
        "  ".join(f"{k}: {v}" for k, v in summary.staleness.items()) or "-",
    )
    if summary.tokens_by_lag:
        total = max(sum(summary.tokens_by_lag.values()), 1)
        shares = "  ".join(
            f"{lag}: {100 * count / total:.0f}%" for lag, count in summary.tokens_by_lag.items()
        )
        mean = summary.version_lag_mean
        table.add_row(
            "trained tokens by version lag",
            shares + ("" if mean is None else f"  (mean {mean:.2f})"),
        )
        table.add_row(
            "importance ratio by lag",
            "  ".join(f"{lag}: {ratio:.3f}" for lag, ratio in summary.is_ratio_by_lag.items())
            or "-",
        )
    if summary.infra_fault_rate is not None:
        kinds = "  ".join(f"{k}: {v}" for k, v in summary.infra_faults_by_kind.items())
        table.add_row(
            "infrastructure faults (retried, not trained)",
            f"{summary.infra_faults} of {summary.rollout_attempts} attempts "
            f"({100 * summary.infra_fault_rate:.1f}%, worst step "
            f"{100 * (summary.max_step_infra_fault_rate or 0):.1f}%)"
            + (f"  {kinds}" if kinds else ""),
        )
    if summary.weight_sync_bytes_ratio is not None:
        table.add_row(
            "weight sync bytes (delta / raw)",
            f"{summary.weight_sync_bytes_ratio:.4f} over {summary.weight_versions_delta} "
            "delta versions",
        )
    if summary.mean_update_pause_s is not None:
        table.add_row(
            "inference update pauses",
            f"{summary.update_pauses}, mean {summary.mean_update_pause_s:.3f} s",
        )
    if summary.routing_bytes_per_rollout is not None:
        table.add_row(
            "routed-expert bytes per rollout",
            f"{summary.routing_bytes_per_rollout:,.0f} (mean; "
            f"{summary.routing_bytes_per_token or 0:.1f} per token)",
        )
    if summary.rollouts_with_records:
        table.add_row("rollouts that summarized", _summarized(summary))
    if summary.trainer_wait_fraction is not None:
        table.add_row("trainer waiting for data", f"{100 * summary.trainer_wait_fraction:.0f}%")
    if summary.seconds_per_step is not None:
        table.add_row("seconds per step", f"{summary.seconds_per_step:.1f}")
    console.print(table)
    if report is not None:
        console.print(f"report: {report}")
