"""`etude bench e2e`'s two runs: the same work, only the synchrony differs."""

from __future__ import annotations

import tomllib
from pathlib import Path

from services.bench.e2e import CONFIG, _mode_config
from services.config import SERVICE_NAMES
from services.config.deployment import load_config
from services.config.loading import dumps_toml
from services.evals.suites import suite_classes


def test_both_modes_get_the_same_work_with_evals_off_and_their_own_ports(tmp_path: Path) -> None:
    base = tomllib.loads(CONFIG.read_text())
    modes = {
        mode: _mode_config(base, tmp_path / mode, f"bench-e2e-{mode}", steps=7)
        for mode in ("async", "sync")
    }
    for mode, data in modes.items():
        state = str(tmp_path / mode)
        assert data["run"] == {**base["run"], "name": f"bench-e2e-{mode}", "state_dir": state}
        assert data["trainer"]["job"]["max_steps"] == 7
        # No suite is scored: evals would compete with RL for the same cores.
        assert set(data["evals"]["suites"]) >= set(suite_classes())
        assert not any(s["enabled"] for s in data["evals"]["suites"].values())
        assert data["evals"]["watch"] is False
        # The same task stream and the same settings otherwise.
        assert data["reconciler"]["feeder"] == base["reconciler"]["feeder"]
        assert data["trainer"]["job"]["rl"] == base["trainer"]["job"]["rl"]
    ports = [
        modes[m][name][kind]["port"]
        for m in modes
        for name in SERVICE_NAMES
        for kind in ("grpc", "http")
    ]
    assert len(set(ports)) == len(ports)
    config = tmp_path / "async.toml"
    config.write_text(dumps_toml(modes["async"]))
    loaded = load_config(config, environ={})
    assert loaded.trainer.job is not None and loaded.trainer.job.max_steps == 7
