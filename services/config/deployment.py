"""The whole-deployment config: the shared sections, every service's section, the launcher.

``etude run`` and ``etude config show`` read a run config as one deployment; the chart
checks validate it so. A service's process reads only its part
(``services.config.<service>``): the whole deployment is every process's config at
once, so it can stand in for any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import Field

from services.config import ServiceName, SharedConfig
from services.config.envs import EnvsProcessConfig
from services.config.evals import EvalsProcessConfig
from services.config.inference import InferenceProcessConfig
from services.config.launcher import LauncherConfig
from services.config.loading import read_config_data
from services.config.reconciler import ReconcilerProcessConfig
from services.config.trainer import TrainerProcessConfig


# Bases in reverse: pydantic orders inherited fields from the last base to the first, so
# the sections read reconciler, envs, inference, trainer, evals. Each base's rules (the
# inference process's one-model rule) hold for the whole deployment too.
class EtudeConfig(
    EvalsProcessConfig,
    TrainerProcessConfig,
    InferenceProcessConfig,
    EnvsProcessConfig,
    ReconcilerProcessConfig,
):
    """A whole deployment: shared sections plus one section per service and the launcher's."""

    launcher: LauncherConfig = Field(
        default_factory=LauncherConfig, description="Local launcher (`etude run`)."
    )


PROCESS_CONFIGS: dict[ServiceName, type[SharedConfig]] = {
    "reconciler": ReconcilerProcessConfig,
    "envs": EnvsProcessConfig,
    "inference": InferenceProcessConfig,
    "trainer": TrainerProcessConfig,
    "evals": EvalsProcessConfig,
}
"""The config each service's process loads (shared sections and its own)."""


def load_config(path: Path | str | None, environ: Mapping[str, str] | None = None) -> EtudeConfig:
    """Loads a TOML run config (defaults when `path` is None) as a whole deployment, with
    the environment's overrides applied."""
    return EtudeConfig.model_validate(read_config_data(path, environ))
