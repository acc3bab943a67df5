"""Where a run's trainer checkpoints live and which directories hold one: no torch here,
so the launcher and the service can ask without importing the trainer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.run_config import EtudeConfig

META_FILE = "etude_checkpoint.json"


def checkpoint_root(config: EtudeConfig) -> Path:
    """Where the run's checkpoints live."""
    return config.trainer.checkpoint_dir or config.run.state_dir / "checkpoints" / config.run.name


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (partial ones are hidden and have no meta)."""
    if not root.is_dir():
        return []
    return [
        path
        for path in root.iterdir()
        if not path.name.startswith(".") and (path / META_FILE).is_file()
    ]
