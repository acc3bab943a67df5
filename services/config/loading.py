"""Reading a run config: one TOML file, then environment overrides, then a model.

One TOML file (``configs/*.toml``) describes a deployment. Environment variables
override any field: ``ETUDE_<SECTION>__<FIELD>[__<FIELD>...]=value``, e.g.
``ETUDE_AUTH__TOKEN=...`` or ``ETUDE_INFERENCE__GRPC__PORT=50053``; the value is parsed
as JSON when it parses, else taken as a string.

A service's process validates the shared sections and its own
(``load_service_config``); the sections of the other services (and ``launcher``) are
left to their readers, so one file serves every process. ``etude run`` and ``etude
config show`` validate the whole deployment (``services.config.deployment``).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from services.config import DEFAULT_MODEL_DIR, SERVICE_NAMES, SharedConfig

ENV_PREFIX = "ETUDE_"

DEPLOYMENT_SECTIONS: tuple[str, ...] = (*SERVICE_NAMES, "launcher")
"""Sections that only some processes read; a process drops those its model lacks."""

ConfigT = TypeVar("ConfigT", bound=SharedConfig)


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


def read_config_data(
    path: Path | str | None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The TOML file at `path` (empty when None) with the environment's overrides applied."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    return apply_env_overrides(data, os.environ if environ is None else environ)


def load_service_config(
    model: type[ConfigT], path: Path | str | None, environ: Mapping[str, str] | None = None
) -> ConfigT:
    """Loads `model` (a process's config) from a run config file and the environment.

    Sections of other services are dropped unread; any other key the model lacks is an
    error, as in every config model.
    """
    data = read_config_data(path, environ)
    _require_one_model(data)
    unread = set(DEPLOYMENT_SECTIONS) - set(model.model_fields)
    return model.model_validate({key: value for key, value in data.items() if key not in unread})


def _require_one_model(data: Mapping[str, Any]) -> None:
    """Every process refuses a file whose ``inference.engine.model_dir`` names another
    model than ``model.dir`` (or its default): the trainer and envs, which do not read the
    inference section, would otherwise start from the default without a word."""
    engine = data.get("inference", {}).get("engine", {})
    named = engine.get("model_dir") if isinstance(engine, Mapping) else None
    if named is None:
        return
    model_dir = data.get("model", {}).get("dir")
    directory = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    if Path(named) != directory:
        default = "" if model_dir is not None else ", its default"
        raise ValueError(
            f"model.dir ({directory}{default}) and inference.engine.model_dir ({named}) "
            "name two models; set model.dir only"
        )


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
