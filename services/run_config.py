"""The whole-deployment config: one TOML file, environment overrides.

One TOML file (``configs/*.toml``) describes a deployment; each service reads the
shared sections (``run``, ``auth``, ``telemetry``, ``endpoints``, ``redis``,
``object_store``) and its own (``[reconciler]``, ``[inference]``, ...).
Environment variables override any field:
``ETUDE_<SECTION>__<FIELD>[__<FIELD>...]=value``, e.g. ``ETUDE_AUTH__TOKEN=...``
or ``ETUDE_INFERENCE__GRPC__PORT=50053``; the value is parsed as JSON when it
parses, else taken as a string. Pydantic only: ``--help`` stays fast.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from services.config import (
    AuthConfig,
    EndpointsConfig,
    LauncherConfig,
    ModelConfig,
    ObjectStoreConfig,
    RedisConfig,
    RunConfig,
    StrictModel,
    TelemetryConfig,
    WeightsConfig,
)
from services.envs.config import EnvsConfig
from services.evals.config import EvalsConfig
from services.inference.config import InferenceConfig
from services.reconciler.config import ReconcilerConfig
from services.trainer.config import TrainerConfig

ENV_PREFIX = "ETUDE_"


class EtudeConfig(StrictModel):
    """A whole deployment: shared sections plus one section per service."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Authentication.")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Telemetry.")
    endpoints: EndpointsConfig = Field(default_factory=EndpointsConfig, description="Addresses.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis.")
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The base model every service shares."
    )
    object_store: ObjectStoreConfig = Field(
        default_factory=ObjectStoreConfig, description="Object store."
    )
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="Weight exchange.")
    reconciler: ReconcilerConfig = Field(
        default_factory=ReconcilerConfig, description="Reconciler service."
    )
    envs: EnvsConfig = Field(default_factory=EnvsConfig, description="Envs service.")
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig, description="Inference service."
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Trainer service.")
    evals: EvalsConfig = Field(default_factory=EvalsConfig, description="Evals service.")
    launcher: LauncherConfig = Field(
        default_factory=LauncherConfig, description="Local launcher (`etude run`)."
    )

    @model_validator(mode="after")
    def _one_model(self) -> EtudeConfig:
        """``model.dir`` is the one model of the run: the inference engine serves it (and the
        trainer and envs, which default to the engine's directory, read it). Naming another
        there is an error, not a choice."""
        if self.model.dir is None:
            if self.model.store_prefix is not None:
                raise ValueError("model.store_prefix needs model.dir: where to sync the model")
            return self
        engine = self.inference.engine
        if "model_dir" in engine.model_fields_set and engine.model_dir != self.model.dir:
            raise ValueError(
                f"model.dir ({self.model.dir}) and inference.engine.model_dir "
                f"({engine.model_dir}) name two models; set model.dir only"
            )
        if engine.model_dir != self.model.dir:
            engine.model_dir = self.model.dir
        return self

    def redacted_json(self) -> str:
        """The resolved config as JSON, secrets masked, for the start-up log."""
        return self.model_dump_json(indent=None)


def _parse_env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def apply_env_overrides(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Returns `data` with every ``ETUDE_A__B__C=value`` variable set at data[a][b][c]."""
    merged = json.loads(json.dumps(data, default=str))
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if not all(path):
            raise ValueError(f"environment variable {name}: empty path component")
        node = merged
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"environment variable {name}: {part!r} is not a section")
            node = child
        node[path[-1]] = _parse_env_value(raw)
    return merged


def load_config(path: Path | str | None, environ: Mapping[str, str] | None = None) -> EtudeConfig:
    """Loads a TOML run config (defaults when `path` is None) and applies env overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    data = apply_env_overrides(data, os.environ if environ is None else environ)
    return EtudeConfig.model_validate(data)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        pairs = (f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + ", ".join(pairs) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dumps_toml(data: Mapping[str, Any], _table: tuple[str, ...] = ()) -> str:
    """``data`` (as ``tomllib`` reads it) as TOML text: scalars first, then subtables.

    Written configs (benchmarks, tests) start from a file's data and change fields,
    rather than appending to it (TOML forbids a table defined twice).
    """
    lines: list[str] = []
    tables = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    for key, value in data.items():
        if key not in tables and value is not None:
            lines.append(f"{json.dumps(key)} = {_toml_value(value)}")
    text = ""
    if _table and lines:
        text += "[" + ".".join(json.dumps(part) for part in _table) + "]\n"
    text += "".join(line + "\n" for line in lines)
    for key, value in tables.items():
        text += dumps_toml(value, (*_table, key))
    return text
