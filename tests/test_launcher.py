"""`etude run` (what `make run` calls): all five services come up and go down cleanly."""

from __future__ import annotations

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
    write_config(config, model_dir=tmp_path / "models" / "tiny", state_dir=tmp_path / "state")
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
    assert "created tiny model" in output  # the model did not exist: the launcher made it
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
