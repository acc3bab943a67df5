"""`etude run` (what `make run` calls): all five services come up and go down cleanly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher.redis_server import redis_answers, start_private_redis
from tests.conftest import REPO, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_etude_run_brings_everything_up_and_down(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    write_config(
        config,
        model_dir=tmp_path / "models" / "tiny",
        state_dir=tmp_path / "state",
        extra={
            "launcher.base_model": [
                "cpt_steps = 1",
                "sft_steps = 1",
                "sft_tasks = 8",
                # One multifile task's transcript joins the SFT data (the default harness's
                # contexts: up to 2,048 tokens).
                "sft_multifile_tasks = 1",
                "sft_max_seq_len = 2048",
            ]
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETUDE_")}
    # No Redis at this URL: the launcher must start its own.
    env["ETUDE_REDIS__URL"] = "redis://127.0.0.1:1/0"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "--config", str(config), "--exit-when-ready"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # The model did not exist: the launcher built it (factory model, CPT, SFT).
    assert "created the tiny factory model" in output
    assert "multifile contexts from 1 tasks among" in output
    assert re.search(r"base model: sft 1 steps", output), output
    assert "started a private redis-server" in output
    assert re.search(r"all 5 services ready in [\d.]+ s", output), output
    stopped = re.findall(r"stopped (\w+) \(pid (\d+)\)(?:: exit (-?\d+))?", output)
    assert {name for name, _, _ in stopped} == {
        "reconciler",
        "envs",
        "inference",
        "trainer",
        "evals",
        "redis",
    }
    for name, pid, code in stopped:
        assert name == "redis" or code == "0", f"{name} exited {code}"
        assert not _alive(int(pid)), f"{name} (pid {pid}) still running"
    logs = tmp_path / "state" / "logs"
    for name in ("reconciler", "envs", "inference", "trainer", "evals"):
        assert f"{name} stopped" in (logs / f"{name}.log").read_text()


def test_private_redis_keeps_an_append_only_file(tmp_path: Path) -> None:
    process, url = start_private_redis(tmp_path)
    try:
        assert redis_answers(url)
    finally:
        process.stop(5)
    assert not redis_answers(url, 0.2)
    assert any((tmp_path / "redis").rglob("*.aof*"))


def test_written_toml_reads_back_as_the_same_config(tmp_path: Path) -> None:
    import tomllib

    from services.config.deployment import load_config
    from services.config.loading import dumps_toml

    data = tomllib.loads((REPO / "configs" / "local.toml").read_text())
    data["evals"]["suites"]["humaneval"]["enabled"] = False
    text = dumps_toml(data)
    assert tomllib.loads(text) == data
    path = tmp_path / "written.toml"
    path.write_text(text)
    config = load_config(path, environ={})
    assert config.evals.suites["humaneval"].enabled is False
    assert config.trainer.job is not None and config.trainer.job.phase == "rl"


def test_step_records_keep_the_newest_of_a_retrained_step(tmp_path: Path) -> None:
    from services.launcher.observe import read_steps

    path = tmp_path / "steps.jsonl"
    lines = [
        {"step": 1, "version": 1, "group_ids": ["a"], "loss": 1.0},
        {"step": 2, "version": 2, "group_ids": ["b"], "loss": 2.0},
        # The trainer died after step 2 and resumed from step 1's checkpoint.
        {"step": 2, "version": 2, "group_ids": ["b"], "loss": 2.5},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3, "ver')
    steps = read_steps(path)
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[1]["loss"] == 2.5
    assert read_steps(tmp_path / "missing.jsonl") == []


def test_summary_counts_groups_staleness_and_versions(tmp_path: Path) -> None:
    from services.launcher.observe import Snapshot
    from services.launcher.summary import summarize, write_report
    from services.objectstore.local import FileObjectStore

    steps = [
        {
            "step": step,
            "version": step,
            "group_ids": [f"g{step}a", f"g{step}b"],
            "staleness": [0, step % 2],
            "rollout_versions": [step - 1, step],
            "rollouts_spanning_versions": 1,
            "reward_total_mean": 0.1 * step,
            "reward_task_mean": 0.1 * step,
            "rollouts": 4.0,
            "groups_uniform_task_reward": 1.0,
            **({"skipped_group_uniform_task_reward": 1.0} if step == 3 else {}),
            "time_wait_s": 1.0,
            "time_compute_s": 3.0,
            "time": 100.0 + 10 * step,
        }
        for step in (1, 2, 3)
    ]
    shot = Snapshot(taken_at=0.0, steps=steps, evals={})
    store = FileObjectStore(tmp_path / "store")
    summary = summarize("r", shot, store)
    assert summary.steps == 3 and summary.groups_trained == 6
    assert summary.groups_trained_twice == 0 and summary.rollouts_trained == 12
    assert summary.staleness == {0: 4, 1: 2}
    assert summary.versions_published == [1, 2, 3]
    assert summary.versions_served == 4  # versions 0..3 appear in rollouts
    assert summary.trainer_wait_fraction == 0.25
    assert summary.seconds_per_step == 10.0
    assert summary.reward_curve == [(1, 0.1), (2, 0.2), (3, 0.30000000000000004)]
    assert summary.groups_uniform_task_reward == 3 and summary.groups_skipped_uniform == 1
    page = write_report(tmp_path / "report", summary, shot, {})
    assert (tmp_path / "report" / "reward.png").stat().st_size > 0
    assert "reward.png" in page.read_text()
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["steps"] == 3


def test_live_view_counts_training_groups_apart_from_kept_eval_results() -> None:
    from rich.console import Console
    from rich.table import Table

    from services.launcher.observe import Snapshot, view

    shot = Snapshot(taken_at=0.0, steps=[{"step": 3, "version": 3}], evals={})
    # 700 finished eval groups stay READY (their results are kept); 5 eval groups run.
    shot.groups_by_state = {"RUNNING": 9, "READY": 702, "COMMITTED": 12}
    shot.training_groups_by_state = {"RUNNING": 4, "READY": 2, "COMMITTED": 12}
    console = Console(width=200, record=True)
    console.print(view(shot, "training", Table(), max_steps=30))
    text = console.export_text()
    assert "training groups" in text and "committed 12  ready 2  running 4" in text
    assert "ready 702" not in text
    assert re.search(r"eval groups running\s+│?\s*5\b", text), text


def test_a_pinned_service_and_its_children_run_on_their_cpus(tmp_path: Path) -> None:
    from services.launcher.processes import ManagedProcess

    cpu = min(os.sched_getaffinity(0))
    # The child starts a grandchild (as vLLM starts its engine): both report their CPUs.
    script = (
        "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), flush=True); "
        "subprocess.run([sys.executable, '-c', "
        "'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    process = ManagedProcess(
        name="pinned",
        argv=[sys.executable, "-c", script],
        log_path=tmp_path / "pinned.log",
        cpus=(cpu,),
    )
    process.start()
    assert process.popen is not None and process.popen.wait(30) == 0
    assert (tmp_path / "pinned.log").read_text().split("\n")[:2] == [f"[{cpu}]"] * 2


def test_cpu_affinity_naming_a_missing_cpu_fails_before_anything_starts(tmp_path: Path) -> None:
    from rich.console import Console

    from services.config.deployment import load_config
    from services.launcher.run import LocalRun, RunFailed, RunOptions

    config = tmp_path / "config.toml"
    missing = max(os.sched_getaffinity(0)) + 1
    write_config(
        config,
        model_dir=tmp_path / "model",
        state_dir=tmp_path / "state",
        extra={"launcher.cpu_affinity": [f"trainer = [{missing}]"]},
    )
    run = LocalRun(load_config(config, environ={}), config, Console(), RunOptions())
    with pytest.raises(RunFailed, match=rf"launcher.cpu_affinity.trainer: CPU \[{missing}\]"):
        run._check_cpu_affinity()


def test_cpu_affinity_needs_a_cpu_per_listed_service() -> None:
    from pydantic import ValidationError

    from services.config.launcher import LauncherConfig

    with pytest.raises(ValidationError, match=r"cpu_affinity\.inference\n.*at least 1 item"):
        LauncherConfig.model_validate({"cpu_affinity": {"inference": []}})


def test_a_run_redis_remembers_without_its_checkpoints_is_refused(tmp_path: Path) -> None:
    import secrets

    import redis
    from rich.console import Console

    from services.config.deployment import load_config
    from services.launcher.run import LocalRun, RunFailed, RunOptions
    from services.reconciler.store import run_prefix
    from services.trainer.paths import META_FILE

    name = f"resume-{secrets.token_hex(4)}"
    config = tmp_path / "config.toml"
    write_config(
        config,
        model_dir=tmp_path / "model",
        state_dir=tmp_path / "state",
        run_name=name,
        extra={"trainer.job": ['phase = "rl"']},
    )
    run = LocalRun(load_config(config, environ={}), config, Console(), RunOptions())
    run._check_resumable()  # nothing in Redis: a new run
    client = redis.Redis.from_url(run.config.redis.url)
    key = f"{run_prefix(name)}:consumer:trainer"
    client.hset(key, "committed_step", 29)
    try:
        with pytest.raises(RunFailed, match=rf"run '{name}' trained through step 29.*--fresh"):
            run._check_resumable()
        partial = tmp_path / "state" / "checkpoints" / name / ".step-30.partial-1"
        partial.mkdir(parents=True)
        (partial / META_FILE).write_text("{}")  # a save that never finished resumes nothing
        with pytest.raises(RunFailed, match="no trainer checkpoint"):
            run._check_resumable()
        checkpoint = tmp_path / "state" / "checkpoints" / name / "step-30"
        checkpoint.mkdir(parents=True)
        (checkpoint / META_FILE).write_text("{}")
        run._check_resumable()  # the checkpoint it resumes from is there
    finally:
        client.delete(key)
        client.close()


def test_rebuild_model_needs_fresh_and_deletes_only_a_model_etude_run_built(
    tmp_path: Path,
) -> None:
    from rich.console import Console

    from services.config.deployment import load_config
    from services.launcher.run import LocalRun, RunFailed, RunOptions

    config = tmp_path / "config.toml"
    model_dir = tmp_path / "models" / "small"
    write_config(config, model_dir=model_dir, state_dir=tmp_path / "state")
    loaded = load_config(config, environ={})

    alone = LocalRun(loaded, config, Console(), RunOptions(rebuild_model=True))
    with pytest.raises(RunFailed, match="--rebuild-model needs --fresh"):
        alone.prepare()
    assert not (tmp_path / "state").exists()  # refused before anything was made

    run = LocalRun(loaded, config, Console(), RunOptions(fresh=True, rebuild_model=True))
    (model_dir).mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(RunFailed, match=r"model_dir .* was not built by `etude run`"):
        run._remove_model()
    assert (model_dir / "config.json").is_file()  # someone's own model stays

    stages = tmp_path / "models" / "small.stages"
    (stages / "cpt").mkdir(parents=True)
    (stages / "cpt" / "config.json").write_text("{}")
    run._remove_model()
    assert not model_dir.exists() and not stages.exists()
    run._remove_model()  # nothing left to remove is not an error


def test_a_failed_service_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    from services.launcher.run import log_tail

    log = tmp_path / "envs.log"
    log.write_text(
        "resolved config: "
        + "x" * 5000
        + "\n"
        + "".join(f"line {i}\n" for i in range(30))
        + "Traceback: ValueError: the cause\n"
    )
    tail = log_tail(log, lines=5, line_chars=40).splitlines()
    assert tail == ["line 26", "line 27", "line 28", "line 29", "Traceback: ValueError: the cause"]
    assert (
        log_tail(log, lines=40, line_chars=40).splitlines()[0]
        == "resolved config: " + "x" * 23 + " …"
    )
    assert log_tail(tmp_path / "missing.log").startswith("(unreadable:")
