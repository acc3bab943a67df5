"""Off-policy visible: the version lag of every trained token (trainer version minus the
version its span says generated it) and the importance ratio by lag, from the record's
spans through packing and the learner to the step record, ``/metrics`` and the run
summary and report."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.trainer import JobConfig
from services.objectstore.local import FileObjectStore
from services.trainer.batch import RLBatch, TrainItem, pack_microbatch
from services.trainer.distributed.batching import pad_item
from services.trainer.distributed.context_parallel import shard_microbatch
from services.trainer.job import TrainingJob
from services.trainer.learner import Learner
from services.trainer.loss import policy_loss
from services.trainer.model import Architecture, load_pretrained, token_logprobs
from services.trainer.offpolicy import lag_metrics, lag_sums, max_lag
from services.trainer.rollouts import RolloutError, SegmentTokens, parse_segment
from services.trainer.runtime import LocalRuntime
from tests.test_trainer_recorded_step import RecordedReconciler, run_config
from tests.trainer_support import (
    one_thread,  # noqa: F401  (autouse: one torch thread)
    sample,
    segment_of,
    store_rollout,
)

LN2 = math.log(2)


def span(version: int, start: int, end: int) -> common_pb2.VersionSpan:
    return common_pb2.VersionSpan(version=version, start=start, end=end)


def test_spans_give_each_generated_target_its_version(tiny_model: Path) -> None:
    arch = Architecture.from_model_dir(tiny_model)
    # 3 prompt tokens, then 2 generated (v4), 2 of tool output, 2 generated (v5).
    segment = common_pb2.Segment(
        token_ids=[5, 6, 7, 10, 11, 12, 13, 14, 15],
        num_prompt_tokens=3,
        logprobs=[-0.5, -0.5, 0.0, 0.0, -0.5, -0.5],
        generated_mask=bytes([1, 1, 0, 0, 1, 1]),
        version_spans=[span(4, 0, 2), span(5, 4, 6)],
    )
    parsed = parse_segment(segment, arch, use_replay=False)
    assert parsed is not None
    # Target j is token j + 1: the two prompt targets, then one per token after the prompt.
    assert parsed.generating_versions == [-1, -1, 4, 4, -1, -1, 5, 5]
    assert parsed.trained == [v >= 0 for v in parsed.generating_versions]

    del segment.version_spans[:]  # a record written without spans: every lag unknown
    parsed = parse_segment(segment, arch, use_replay=False)
    assert parsed is not None and parsed.generating_versions == [-1] * 8

    segment.version_spans.append(span(5, 4, 7))  # one token past the segment
    with pytest.raises(RolloutError) as caught:
        parse_segment(segment, arch, use_replay=False)
    assert caught.value.reason == "version_spans"


def test_lag_histogram_and_ratio_by_lag_of_known_tokens() -> None:
    """Versions and logprobs by hand; every ratio a power of two, so exact in float32."""
    policy_version = 7
    # (generating version, log pi_theta, log pi_behaviour) in units of ln 2.
    tokens = [
        (7, -1, -1),  # lag 0, ratio 1
        (7, -1, -2),  # lag 0, ratio 2
        (6, -2, -1),  # lag 1, ratio 0.5
        (6, -1, -1),  # lag 1, ratio 1
        (6, 0, -1),  # lag 1, ratio 2
        (5, -1, -3),  # lag 2, ratio 4
        (3, -3, -1),  # lag 4 (3+), ratio 0.25
        (1, -1, -1),  # lag 6 (3+), ratio 1
        (-1, -1, -1),  # no span: unknown
        (8, -1, -1),  # newer than the trainer (a wrong record): unknown
    ]
    versions = torch.tensor([v for v, _, _ in tokens])
    logprobs = torch.tensor([lp for _, lp, _ in tokens], dtype=torch.float32) * LN2
    behaviour = torch.tensor([b for _, _, b in tokens], dtype=torch.float32) * LN2
    ones = torch.ones(len(tokens))
    terms = policy_loss(logprobs, behaviour, ones, ones, normalizer=1.0, importance_cap=2.0)

    figures = lag_metrics(
        lag_sums(versions, terms.importance_ratio, policy_version),
        max_lag(versions, policy_version),
    )
    assert figures == {
        "tokens_lag0": 2.0,
        "tokens_lag1": 3.0,
        "tokens_lag2": 1.0,
        "tokens_lag3+": 2.0,
        "tokens_lag_unknown": 2.0,
        "is_ratio_mean_lag0": 1.5,
        "is_ratio_mean_lag1": 3.5 / 3,
        "is_ratio_mean_lag2": 4.0,
        "is_ratio_mean_lag3+": 0.625,
        "version_lag_mean": 15 / 8,
        "version_lag_max": 6,
    }
    # Sums of parts add up (over microbatches and ranks) to the sums of the whole.
    first = lag_sums(versions[:4], terms.importance_ratio[:4], policy_version)
    rest = lag_sums(versions[4:], terms.importance_ratio[4:], policy_version)
    whole = lag_sums(versions, terms.importance_ratio, policy_version)
    assert {name: first[name] + rest[name] for name in whole} == whole


def tagged_items() -> list[TrainItem]:
    """Two rollouts of one prompt and one sequence without versions; each trained token's
    behaviour logprob is -(its version + 1), so a packing that kept them together keeps
    that relation."""
    prompt = [3, 30, 31, 32]
    items: list[TrainItem] = []
    for versions in ([4, 4, 5], [3, 5, 5, 5]):
        tokens = prompt + [100 + v for v in versions]
        generating = [-1] * (len(prompt) - 1) + versions
        segment = SegmentTokens(
            input_ids=tokens[:-1],
            targets=tokens[1:],
            trained=[v >= 0 for v in generating],
            behaviour_logprobs=[-(v + 1.0) if v >= 0 else 0.0 for v in generating],
            replay=None,
            generating_versions=generating,
        )
        items.append((segment, 1.0, 1.0))
    plain = SegmentTokens([3, 40, 41], [40, 41, 42], [False, True, True], [0, -1.0, -1.0], None)
    items.append((plain, -1.0, 1.0))
    return items


@pytest.mark.parametrize("share_prefixes", [False, True])
def test_versions_travel_with_their_tokens_through_packing(share_prefixes: bool) -> None:
    microbatch = pack_microbatch(tagged_items(), 2, 2, share_prefixes=share_prefixes)
    trained = microbatch.trained
    versions = microbatch.generating_versions[trained]
    assert sorted(versions.tolist()) == [-1, -1, 3, 4, 4, 5, 5, 5, 5]
    known = versions >= 0
    behaviour = microbatch.behaviour_logprobs[trained][known]
    assert torch.equal(behaviour, -(versions[known] + 1).float())
    assert (microbatch.generating_versions[~trained] == -1).all()


def test_versions_survive_context_parallel_padding_and_sharding() -> None:
    cp = 2
    padded = [pad_item(item, cp)[0] for item in tagged_items()]
    whole = pack_microbatch(padded, 2, 2)
    shards = [shard_microbatch(whole, index, cp) for index in range(cp)]
    versions = torch.cat([shard.generating_versions[shard.trained] for shard in shards])
    assert sorted(versions.tolist()) == [-1, -1, 3, 4, 4, 5, 5, 5, 5]
    for shard in shards:
        trained, known = shard.trained, shard.generating_versions >= 0
        assert torch.equal(
            shard.behaviour_logprobs[trained & known],
            -(shard.generating_versions[trained & known] + 1).float(),
        )


def lagged_items(seed: int) -> list[TrainItem]:
    """Sequences whose generated tails span versions 1..5 (a rollout across updates)."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for index, length in enumerate((23, 9, 40, 17)):
        tokens = torch.randint(16, 900, (length + 1,), generator=generator).tolist()
        num_prompt = length // 3
        tail = length - num_prompt
        versions = [5 - index - (j * 2 // tail) for j in range(tail)]  # two versions each
        segment = SegmentTokens(
            input_ids=tokens[:-1],
            targets=tokens[1:],
            trained=[False] * num_prompt + [True] * tail,
            behaviour_logprobs=(-4 - torch.rand(length, generator=generator)).tolist(),
            replay=None,
            generating_versions=[-1] * num_prompt + versions,
        )
        items.append((segment, float(index % 2) - 0.5, 1.0))
    return items


def test_learner_reports_lags_and_ratio_by_lag_of_its_own_logprobs(tiny_model: Path) -> None:
    job = JobConfig.model_validate(
        {
            "phase": "rl",
            "model": {"compute_dtype": "float32"},
            "rl": {"kl_coef": 0.0, "generation_budget_tokens": 32},
        }
    )
    learner = Learner.load(tiny_model, job)
    items = lagged_items(4)
    microbatches = [pack_microbatch(items[:2], 2, 2), pack_microbatch(items[2:], 2, 2)]
    policy_version = 5
    # The trainer's logprobs before the step, as the step computes them.
    ratios, versions = [], []
    with torch.no_grad():
        for microbatch in microbatches:
            rows = microbatch.trained.nonzero()[:, 0]
            output = learner.model(microbatch.inputs)
            logprobs, _ = token_logprobs(
                learner.model, output.hidden[rows], microbatch.targets[rows]
            )
            ratios.append(torch.exp(logprobs - microbatch.behaviour_logprobs[rows]))
            versions.append(microbatch.generating_versions[rows])
    ratio, lag = torch.cat(ratios).double(), policy_version - torch.cat(versions)

    metrics = learner.rl_step(
        RLBatch(microbatches, 4, [], [], [], policy_version=policy_version), 0
    )
    expected_tokens = {"0": 8, "1": 11, "2": 17, "3+": 25}  # from the versions above
    for bucket, count in expected_tokens.items():
        assert metrics[f"tokens_lag{bucket}"] == count
        chosen = lag.clamp(max=3) == (3 if bucket == "3+" else int(bucket))
        assert int(chosen.sum()) == count
        assert metrics[f"is_ratio_mean_lag{bucket}"] == pytest.approx(
            float(ratio[chosen].mean()), rel=1e-5
        )
    assert metrics["tokens_lag_unknown"] == 0 and metrics["tokens_trained"] == 61
    assert metrics["version_lag_mean"] == (11 * 1 + 17 * 2 + 19 * 3 + 6 * 4) / 61
    assert metrics["version_lag_max"] == 4
    by_lag = sum(metrics[f"is_ratio_mean_lag{b}"] * n for b, n in expected_tokens.items())
    assert by_lag / 61 == pytest.approx(metrics["is_ratio_mean"], rel=1e-9)


def sample_value(name: str, lag: str) -> float:
    value = REGISTRY.get_sample_value(name, {"lag": lag})
    return 0.0 if value is None else value


def test_step_records_and_metrics_carry_the_lags(tiny_model: Path, tmp_path: Path) -> None:
    """Rollouts half from version 1 and half from version 2, trained twice by a trainer
    that starts at version 2: lags 1 and 0 at the first step, 2 and 1 at the second."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model, model_dir)
    card = model_dir / "etude_model.json"
    card.write_text(json.dumps(json.loads(card.read_text()) | {"policy_version": 2}))
    store = FileObjectStore(tmp_path / "store")
    policy = load_pretrained(model_dir, dtype=torch.float32)
    prompts = [[3, 300 + g, 40 + g] for g in range(2) for _ in range(4)]
    samples = sample(policy, prompts, 6, torch.Generator().manual_seed(3))
    groups = []
    for g in range(2):
        summaries = []
        for i, item in enumerate(samples[4 * g : 4 * g + 4]):
            segment = segment_of(item)
            del segment.version_spans[:]
            segment.version_spans.extend([span(1, 0, 3), span(2, 3, 6)])
            reward = float(i % 2)
            summaries.append(store_rollout(store, f"group-{g}", i, [segment], reward))
        groups.append(reconciler_pb2.Group(group_id=f"group-{g}", rollouts=summaries))
    metrics_file = tmp_path / "steps.jsonl"
    config = run_config(
        tmp_path,
        {
            "phase": "rl",
            "max_steps": 2,
            "metrics_file": str(metrics_file),
            "model": {"model_dir": str(model_dir), "compute_dtype": "float32"},
            "rl": {"groups_per_step": 2, "pull_wait_s": 0.1, "generation_budget_tokens": 8},
        },
    )
    buckets = ("0", "1", "2", "3+", "unknown")
    before = {b: sample_value("etude_trainer_trained_tokens_total", b) for b in buckets}
    reconciler = RecordedReconciler(groups)
    job = TrainingJob.build(config, store, reconciler, LocalRuntime())  # type: ignore[arg-type]
    asyncio.run(job.run())
    assert job.state == "done", job.error

    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [(r["step"], r["version"]) for r in records] == [(1, 3), (2, 4)]
    expected = [{"0": 24, "1": 24, "2": 0, "3+": 0}, {"0": 0, "1": 24, "2": 24, "3+": 0}]
    for record, tokens in zip(records, expected, strict=True):
        assert {b: record[f"tokens_lag{b}"] for b in tokens} == tokens
        assert record["tokens_lag_unknown"] == 0
        assert record["version_lag_mean"] == (0.5 if record["step"] == 1 else 1.5)
        assert record["version_lag_max"] == record["step"]
        for bucket, count in tokens.items():
            ratio = record[f"is_ratio_mean_lag{bucket}"]
            assert ratio > 0 if count else ratio == 0
    # /metrics: tokens counted by lag over both steps; the ratio gauges hold the last step's.
    added = {b: sample_value("etude_trainer_trained_tokens_total", b) - before[b] for b in buckets}
    assert added == {"0": 24, "1": 48, "2": 24, "3+": 0, "unknown": 0}
    last = records[-1]
    for bucket in ("1", "2"):
        gauge = sample_value("etude_trainer_importance_ratio_by_lag", bucket)
        assert gauge == last[f"is_ratio_mean_lag{bucket}"]
    for bucket in ("0", "3+"):
        assert math.isnan(sample_value("etude_trainer_importance_ratio_by_lag", bucket))
    assert job.metrics["tokens_lag2"] == 24  # GetStatus.metrics and the step-metric gauge
    assert REGISTRY.get_sample_value("etude_trainer_step_metric", {"name": "tokens_lag2"}) == 24


def lag_record(step: int, tokens: dict[str, int], ratios: dict[str, float], **more: float) -> dict:
    record: dict = {"step": step, "version": step, "group_ids": [f"g{step}"], **more}
    for bucket in ("0", "1", "2", "3+"):
        record[f"tokens_lag{bucket}"] = float(tokens.get(bucket, 0))
        record[f"is_ratio_mean_lag{bucket}"] = ratios.get(bucket, 0.0)
    known = sum(tokens.values())
    lags = sum(count * (3 if b == "3+" else int(b)) for b, count in tokens.items())
    record["version_lag_mean"] = lags / known
    return record


def test_summary_and_report_show_tokens_and_ratio_by_lag(tmp_path: Path) -> None:
    from rich.console import Console

    from services.launcher.observe import Snapshot
    from services.launcher.summary import print_summary, summarize, write_report

    steps = [
        lag_record(1, {"0": 30, "1": 10}, {"0": 1.0, "1": 0.5}, tokens_lag_unknown=0.0),
        lag_record(
            2, {"0": 10, "1": 20, "2": 10}, {"0": 1.5, "1": 0.75, "2": 0.25}, tokens_lag_unknown=4.0
        ),
        {"step": 3, "version": 3, "group_ids": ["g3"]},  # a record without lag figures
    ]
    shot = Snapshot(taken_at=0.0, steps=steps, evals={})
    summary = summarize("r", shot, FileObjectStore(tmp_path / "store"))
    assert summary.tokens_by_lag == {"0": 40, "1": 30, "2": 10, "3+": 0, "unknown": 4}
    assert summary.is_ratio_by_lag == {"0": 45 / 40, "1": 20 / 30, "2": 0.25}
    assert summary.version_lag_mean == (40 * 0.25 + 40 * 1.0) / 80

    page = write_report(tmp_path / "report", summary, shot, {})
    assert (tmp_path / "report" / "offpolicy.png").stat().st_size > 0
    assert 'src="offpolicy.png"' in page.read_text()
    saved = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert saved["tokens_by_lag"] == summary.tokens_by_lag
    assert saved["is_ratio_by_lag"] == summary.is_ratio_by_lag
    assert saved["version_lag_mean"] == 0.625

    console = Console(width=200, record=True)
    print_summary(console, summary, None)
    text = console.export_text()
    assert "0: 48%  1: 36%  2: 12%  3+: 0%  unknown: 5%  (mean 0.62)" in text
    assert "0: 1.125  1: 0.667  2: 0.250" in text


def test_summary_of_a_run_without_lag_figures_leaves_them_out(tmp_path: Path) -> None:
    from rich.console import Console

    from services.launcher.observe import Snapshot
    from services.launcher.summary import print_summary, summarize, write_report

    shot = Snapshot(taken_at=0.0, steps=[{"step": 1, "version": 1}], evals={})
    summary = summarize("r", shot, FileObjectStore(tmp_path / "store"))
    assert summary.tokens_by_lag == {} and summary.is_ratio_by_lag == {}
    assert summary.version_lag_mean is None
    write_report(tmp_path / "report", summary, shot, {})  # an empty plot, not an error
    console = Console(width=200, record=True)
    print_summary(console, summary, None)
    assert "version lag" not in console.export_text()
