"""The eval report: one HTML page, a PNG per metric against policy version, the JSON.

``render(run, records)`` returns the files by name (``index.html``, ``results.json``,
``<metric>.png``); the service stores them in the object store and serves them over
HTTP, ``etude evals report`` writes them to a directory. Images are referenced by
relative names, so the page works in both places. Plots use matplotlib's object API
(no pyplot state), so rendering is safe off the main thread.
"""

from __future__ import annotations

import html
import io
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from services.evals.intervals import gain_interval
from services.evals.record import EvalRecord, Interval

MAX_TASK_TABLE_VERSIONS = 8

Getter = Callable[[EvalRecord], float | None]


@dataclass(frozen=True)
class Metric:
    """One plotted metric: file stem, title, how to read it (and its interval) from a
    record."""

    stem: str
    title: str
    value: Getter
    interval: Callable[[EvalRecord], Interval | None] | None = None


def _pass_at(k: int) -> Getter:
    return lambda record: record.pass_at_k.get(k)


def metrics(records: Mapping[str, Sequence[EvalRecord]]) -> list[Metric]:
    """The metrics plotted: pass@1, pass@k for every k seen, best-of-K, rewards, lengths."""
    ks = sorted({k for rs in records.values() for r in rs for k in r.pass_at_k if k > 1})
    return [
        Metric(
            "pass_at_1",
            "pass@1 (95 % interval over tasks)",
            lambda r: r.pass_at_1,
            lambda r: r.pass_at_1_interval,
        ),
        *(Metric(f"pass_at_{k}", f"pass@{k} (unbiased)", _pass_at(k)) for k in ks),
        Metric("best_of_k", "best-of-K (best sample's score)", lambda r: r.best_of_k),
        Metric("reward_total", "mean reward (total)", lambda r: r.mean_reward.total),
        Metric("reward_task", "mean reward: task", lambda r: r.mean_reward.task),
        Metric(
            "reward_length_penalty",
            "mean reward: length penalty",
            lambda r: r.mean_reward.length_penalty,
        ),
        Metric("reward_behaviour", "mean reward: behaviour", lambda r: r.mean_reward.behaviour),
        Metric("tokens", "generated tokens per rollout", lambda r: r.mean_tokens),
        Metric("turns", "turns per rollout", lambda r: r.mean_turns),
        Metric("tool_calls", "tool calls per rollout", lambda r: r.mean_tool_calls),
        Metric("summaries", "self-summaries per rollout", lambda r: r.mean_summaries),
    ]


def plot(metric: Metric, records: Mapping[str, Sequence[EvalRecord]]) -> bytes:
    """A PNG of `metric` against policy version, one line per suite."""
    figure = Figure(figsize=(6.4, 3.4), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    for suite, suite_records in sorted(records.items()):
        shown = [(r, y) for r in suite_records if (y := metric.value(r)) is not None]
        if not shown:
            continue
        versions = [r.policy_version for r, _ in shown]
        values = [y for _, y in shown]
        intervals = [metric.interval(r) for r, _ in shown] if metric.interval else []
        if intervals and all(intervals):
            below = [max(y - i.low, 0.0) for (_, y), i in zip(shown, intervals, strict=True) if i]
            above = [max(i.high - y, 0.0) for (_, y), i in zip(shown, intervals, strict=True) if i]
            axes.errorbar(versions, values, yerr=[below, above], marker="o", capsize=3, label=suite)
        else:
            axes.plot(versions, values, marker="o", label=suite)
    axes.set_title(metric.title)
    axes.set_xlabel("policy version")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return html.escape(str(value))


def _with_interval(value: float, interval: Interval | None) -> str:
    if interval is None:
        return f"{value:.3f}"
    return f"{value:.3f} [{interval.low:.3f}, {interval.high:.3f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _versions_table(records: Sequence[EvalRecord]) -> str:
    ks = sorted({k for r in records for k in r.pass_at_k if k > 1})
    header = [
        "version",
        "sampled by",
        "tasks",
        "K",
        "pass@1 [95 %]",
        *(f"pass@{k}" for k in ks),
        "best-of-K",
        "reward",
        "tokens",
        "turns",
        "tool calls",
        "summaries",
        "failures",
        "dropped",
        "retried",
        "left out",
    ]
    rows = []
    for r in sorted(records, key=lambda r: -r.policy_version):
        by = r.generated_by
        failures = ", ".join(
            f"{reason} {count}"
            for reason, count in sorted(r.failure_reasons.items(), key=lambda item: -item[1])
        )
        rows.append(
            [
                r.policy_version,
                (
                    f"v{by.min_version}"
                    if by.min_version == by.max_version
                    else f"v{by.min_version}-v{by.max_version}"
                )
                + (f" (in run {r.reused_from})" if r.reused_from else ""),
                r.num_tasks,
                r.num_samples,
                _with_interval(r.pass_at_1, r.pass_at_1_interval),
                *(r.pass_at_k.get(k, "") for k in ks),
                r.best_of_k,
                r.mean_reward.total,
                r.mean_tokens,
                r.mean_turns,
                r.mean_tool_calls,
                r.mean_summaries,
                failures or "-",
                len(r.dropped_tasks),
                r.num_retried,
                _left_out(r),
            ]
        )
    return _table(header, rows)


def _left_out(record: EvalRecord) -> str:
    if not record.num_left_out:
        return "0"
    by = ", ".join(f"{name} {count}" for name, count in sorted(record.left_out_by.items()))
    return f"{record.num_left_out} ({by})"


def gain_line(records: Sequence[EvalRecord]) -> str:
    """pass@1 of the newest version minus the oldest's, with its 95 % interval."""
    first = min(records, key=lambda r: r.policy_version)
    last = max(records, key=lambda r: r.policy_version)
    if first is last:
        figure = _with_interval(first.pass_at_1, first.pass_at_1_interval)
        return f"pass@1 v{first.policy_version}: {figure} (95 %)"
    gain = 100 * (last.pass_at_1 - first.pass_at_1)
    interval = gain_interval(first, last)
    common = len({t.task_id for t in first.tasks} & {t.task_id for t in last.tasks})
    return (
        f"pass@1 gain v{first.policy_version} -> v{last.policy_version}: {gain:+.1f} points "
        f"[{100 * interval.low:+.1f}, {100 * interval.high:+.1f}] (95 %, paired over the "
        f"{common} tasks both were scored on; v{first.policy_version} {first.num_tasks} tasks "
        f"x {first.num_samples}, v{last.policy_version} {last.num_tasks} x {last.num_samples})"
        f"{_half_widths(first, last)}"
    )


def _half_widths(first: EvalRecord, last: EvalRecord) -> str:
    """The two pass@1 intervals' half-widths (version 0's is meant to be half or less)."""
    if first.pass_at_1_interval is None or last.pass_at_1_interval is None:
        return ""
    return (
        f"; pass@1 interval half-widths v{first.policy_version} "
        f"{first.pass_at_1_interval.half_width:.3f}, v{last.policy_version} "
        f"{last.pass_at_1_interval.half_width:.3f}"
    )


def _tasks_table(records: Sequence[EvalRecord]) -> str:
    shown = sorted(records, key=lambda r: r.policy_version)[-MAX_TASK_TABLE_VERSIONS:]
    latest = shown[-1]
    by_version = [{t.task_id: t for t in r.tasks} for r in shown]
    task_ids = list(dict.fromkeys(t.task_id for r in shown for t in r.tasks))
    header = ["task", *(f"v{r.policy_version} correct" for r in shown), "latest reward"]
    rows = []
    for task_id in task_ids:
        cells: list[object] = [task_id]
        for tasks in by_version:
            task = tasks.get(task_id)
            cells.append(f"{task.num_correct}/{task.num_samples}" if task else "-")
        latest_task = by_version[-1].get(task_id)
        cells.append(latest_task.mean_reward if latest_task else "-")
        rows.append(cells)
    return (
        f"<p>Correct samples per task, last {len(shown)} versions "
        f"(newest v{latest.policy_version}).</p>" + _table(header, rows)
    )


_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:80em}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:0.2em 0.6em;text-align:right}"
    "th:first-child,td:first-child{text-align:left}"
    "img{margin:0.3em;border:1px solid #eee}"
    "p.note{color:#555;font-size:0.9em}"
)


def render_html(
    run: str, records: Mapping[str, Sequence[EvalRecord]], images: Sequence[tuple[str, str]]
) -> str:
    """The page: per suite a versions table and a per-task table; every plot."""
    title = f"etude evals: run {html.escape(run)}"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>",
        f"<style>{_STYLE}</style></head><body><h1>{title}</h1>",
        f"<p>Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')}. "
        "<a href='results.json'>results.json</a> holds every figure below.</p>",
        "<p class='note'>pass@k is the unbiased estimator over K samples per task; best-of-K "
        "is the mean over tasks of the best sample's grader score. The interval of pass@1 "
        "and of a gain is a 95 % bootstrap over tasks (a gain's paired over the tasks both "
        "versions have). A version's figures use only the rollouts that version sampled "
        "alone (inference follows new versions while an eval runs): 'retried' counts the "
        "rollouts asked for again because an older version sampled them, 'left out' those "
        "still sampled by other versions (by which), left out of every figure. Version 0 "
        "is scored once per base model, tasks and rollout settings: 'in run' names the run "
        "whose score this run took.</p>",
        "<h2>Metrics by policy version</h2>",
        *(
            f"<img src='{html.escape(name)}' alt='{html.escape(alt)}' width='640' height='340'>"
            for name, alt in images
        ),
    ]
    for suite, suite_records in sorted(records.items()):
        if not suite_records:
            continue
        latest = max(suite_records, key=lambda r: r.policy_version)
        parts += [
            f"<h2>{html.escape(suite)}</h2>",
            f"<p>family {html.escape(latest.family)}, {latest.num_tasks} tasks, "
            f"K = {latest.num_samples}</p>",
            f"<p>{html.escape(gain_line(suite_records))}</p>",
            _versions_table(suite_records),
            f"<h3>{html.escape(suite)}: per task</h3>",
            _tasks_table(suite_records),
        ]
    parts.append("</body></html>")
    return "\n".join(parts)


def results_json(run: str, records: Mapping[str, Sequence[EvalRecord]]) -> bytes:
    """Every record, by suite, ordered by version."""
    payload = {
        "run": run,
        "generated_at": time.time(),
        "suites": {
            suite: [r.model_dump(mode="json") for r in sorted(rs, key=lambda r: r.policy_version)]
            for suite, rs in sorted(records.items())
        },
    }
    return json.dumps(payload, indent=2).encode()


def render(run: str, records: Mapping[str, Sequence[EvalRecord]]) -> dict[str, bytes]:
    """Every file of the report, by name."""
    ordered = {s: sorted(rs, key=lambda r: r.policy_version) for s, rs in records.items() if rs}
    files: dict[str, bytes] = {}
    images = []
    for metric in metrics(ordered):
        name = f"{metric.stem}.png"
        files[name] = plot(metric, ordered)
        images.append((name, metric.title))
    files["index.html"] = render_html(run, ordered, images).encode()
    files["results.json"] = results_json(run, ordered)
    return files
