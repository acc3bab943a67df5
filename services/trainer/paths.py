"""Where a run's trainer checkpoints live and which ones are complete: no torch here, so
the launcher and the service can ask without importing the trainer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.config.trainer import CheckpointConfig

if TYPE_CHECKING:
    from services.config.trainer import TrainerProcessConfig

META_FILE = "etude_checkpoint.json"
MANIFEST = "manifest.json"


def checkpoint_root(config: TrainerProcessConfig) -> Path:
    """The run's local checkpoint directory (with checkpoints in the object store, where
    saves and resumes stage their files)."""
    return config.trainer.checkpoint_dir or config.run.state_dir / "checkpoints" / config.run.name


def checkpoint_config(config: TrainerProcessConfig) -> CheckpointConfig:
    """The job's checkpoint settings (the defaults for a trainer without a job)."""
    job = config.trainer.job
    return job.checkpoint if job is not None else CheckpointConfig()


def checkpoints_in_store(config: TrainerProcessConfig) -> bool:
    """Whether the run's checkpoints live in the object store (``checkpoint.location``)."""
    location = checkpoint_config(config).location
    if location == "auto":
        return config.object_store.url.startswith("s3://")
    return location == "object_store"


def checkpoint_prefix(config: TrainerProcessConfig) -> str:
    """The key prefix of the run's checkpoints in the object store."""
    return f"{checkpoint_config(config).prefix}/{config.run.name}"


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (partial ones are hidden and have no meta)."""
    if not root.is_dir():
        return []
    return [
        path
        for path in root.iterdir()
        if not path.name.startswith(".") and (path / META_FILE).is_file()
    ]


def manifest_names(keys: list[str], prefix: str) -> list[str]:
    """The checkpoints with a manifest (the complete ones) among the object-store ``keys``
    under ``prefix`` (``<prefix>/<name>/manifest.json``)."""
    start, end = f"{prefix}/", f"/{MANIFEST}"
    names = [
        key[len(start) : -len(end)] for key in keys if key.startswith(start) and key.endswith(end)
    ]
    return [name for name in names if name and "/" not in name]
