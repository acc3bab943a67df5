"""The chart's trainer keeps its checkpoints where a rescheduled pod finds them: in the
object store for an s3:// store, and its checkpoint directory is the checkpoint volume."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import chart_check  # noqa: E402

from services.config.deployment import load_config  # noqa: E402
from services.trainer.paths import checkpoint_root, checkpoints_in_store  # noqa: E402

chart_check.require_tools()  # a missing tool fails the module loudly, never skips


def test_the_trainer_checkpoints_to_the_store_and_stages_on_its_volume(tmp_path: Path) -> None:
    manifests = chart_check.render({"trainer": {"checkpoints": {"mountPath": "/ckpt"}}})
    path = tmp_path / "config.toml"
    path.write_text(chart_check.find(manifests, "ConfigMap", "etude-config")["data"]["config.toml"])
    config = load_config(path, environ={"ETUDE_AUTH__TOKEN": "t"})
    assert config.object_store.url.startswith("s3://") and checkpoints_in_store(config)
    assert checkpoint_root(config) == Path("/ckpt")
    statefulset = chart_check.find(manifests, "StatefulSet", "etude-trainer")
    mounts = statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in mounts
