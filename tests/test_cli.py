"""The `etude` command: fast help, clear errors, the benchmarks contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "vllm", "transformers", "grpc", "opentelemetry", "fastapi")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "sys.argv = ['etude', '--help']\n"
        "from services.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "run" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("service", ["reconciler", "envs", "inference", "trainer", "evals"])
def test_service_help_imports_nothing_heavy(service: str) -> None:
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['x', '--help']\n"
        "try:\n"
        f"    runpy.run_module('services.{service}', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "--config" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_unknown_service_and_preset_are_refused() -> None:
    done = _run("serve", "nosuch")
    assert done.returncode == 2 and "unknown service 'nosuch'" in done.stderr
    done = _run("model", "init", "--preset", "huge", "--out", "/tmp/never")
    assert done.returncode == 2 and "unknown preset 'huge'" in done.stderr


def _service(service: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", f"services.{service}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_invalid_config_is_refused_by_the_processes_that_read_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[inference.engine]\nmax_model_len = -1\n")
    done = _run("config", "show", "--config", str(bad))
    assert done.returncode == 2 and "max_model_len" in done.stderr
    done = _service("inference", "--config", str(bad))
    assert done.returncode == 2 and "max_model_len" in done.stderr
    # The trainer reads the shared sections and [trainer]: [inference] is not its to judge.
    done = _service(
        "trainer",
        "--config",
        str(bad),
        "--print-config",
        env={"ETUDE_TRAINER__GRPC__PORT": "50999", "ETUDE_INFERENCE__NOSUCH": "1"},
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["trainer"]["grpc"]["port"] == 50999 and "inference" not in printed


def test_model_init_command(tmp_path: Path) -> None:
    done = _run("model", "init", "--preset", "tiny", "--out", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    assert "tiny:" in done.stdout and (tmp_path / "m" / "model.safetensors").is_file()
    again = _run("model", "init", "--preset", "tiny", "--out", str(tmp_path / "m"))
    assert again.returncode == 1 and "exists" in again.stderr


def test_bench_contract() -> None:
    done = _run("bench", "grpc", "--quick", "--json")
    assert done.returncode in (0, 1), done.stderr  # 1 only when the target is missed
    result = json.loads(done.stdout)
    assert result["bench"] == "grpc"
    assert set(result) >= {"bench", "figures", "baseline", "ok", "target"}
    assert result["ok"] == (done.returncode == 0)
    figures, baseline = result["figures"], result["baseline"]
    assert figures["calls_per_s"] > 0 and baseline["calls_per_s"] > 0
    ratio = baseline["calls_per_s"] / figures["calls_per_s"]
    assert figures["overhead_ratio"] == pytest.approx(ratio)
    assert result["ok"] == (ratio <= 2.0)
    unknown = _run("bench", "nosuch", "--json")
    assert unknown.returncode == 2 and "unknown benchmark" in unknown.stderr


def test_a_wrong_bench_setting_is_named_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETUDE_BENCH_REPLAY_SHAPE", "16x64")
    done = _run("bench", "replay", "--json")
    assert done.returncode == 2 and not done.stdout
    assert "replay: ETUDE_BENCH_REPLAY_SHAPE='16x64': expected layers:experts" in done.stderr
    assert "Traceback" not in done.stderr


def test_tasks_export_writes_what_the_jsonl_feeder_reads(tmp_path: Path) -> None:
    """To a file and to an object-store key; the feeder reads back the generator's tasks."""
    from services.config import ObjectStoreConfig
    from services.config.reconciler import FeederConfig
    from services.families.synthetic import task_at
    from services.objectstore import open_store
    from services.reconciler.feeders import build_feeder

    config = tmp_path / "config.toml"
    config.write_text(f'[object_store]\nurl = "file://{tmp_path}/store"\n')
    out = tmp_path / "tasks.jsonl"
    done = _run("tasks", "export", "--count", "5", "--seed", "3", "--out", str(out))
    assert done.returncode == 0 and "5 tasks" in done.stdout, done.stderr
    done = _run("tasks", "export", "--count", "5", "--seed", "3", "--key", "t/train.jsonl",
                "-c", str(config))  # fmt: skip
    assert done.returncode == 0 and "object t/train.jsonl" in done.stdout, done.stderr
    expected = [task_at(position, 3) for position in range(5)]
    store = open_store(ObjectStoreConfig(url=f"file://{tmp_path}/store"))
    for feeder in (
        build_feeder(FeederConfig(path=out)),
        build_feeder(FeederConfig(key="t/train.jsonl"), store),
    ):
        assert feeder.tasks_from(0, 10) == expected

    for wrong in (["--count", "1"], ["--count", "1", "--out", str(out), "--key", "k"]):
        assert _run("tasks", "export", *wrong).returncode == 2
    refused = _run("tasks", "export", "--count", "1", "--key", "../x", "-c", str(config))
    assert refused.returncode == 2 and "--key" in refused.stderr
