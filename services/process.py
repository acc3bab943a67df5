"""Start-up of a service process: arguments and config first, heavy imports after.

``python -m services.<svc> --config FILE`` and ``etude serve <svc> --config FILE``
both land here. The process's own config (the shared sections and its service's
section, ``services.config.<svc>``) is parsed and validated, logging is set up, the
resolved config is logged as JSON, and only then is the service module (which
may import torch or vLLM) imported and run.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from services.config import SERVICE_NAMES, ServiceName, SharedConfig
from services.config.loading import load_service_config

log = logging.getLogger("etude")


def parse_args(service: ServiceName, argv: list[str] | None) -> argparse.Namespace:
    """The command line every service process takes."""
    module = sys.modules.get(f"services.{service}.__main__")
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{service}",
        description=(module.__doc__ if module and module.__doc__ else f"etude {service}").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="TOML run config (default: built-in defaults)"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    return parser.parse_args(argv)


def run_service(service: ServiceName, config: SharedConfig) -> int:
    """Imports the service's module and runs it until it stops; returns the exit code."""
    if service not in SERVICE_NAMES:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICE_NAMES)}")
    from services.telemetry import configure_logging

    configure_logging(config.telemetry, service)
    log.info("resolved config: %s", config.redacted_json())
    try:
        if service in MODEL_READERS:
            bring_model(config)
        module = importlib.import_module(f"services.{service}.service")
        module.run(config)
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("%s exited with an error", service)
        return 1
    return 0


MODEL_READERS: tuple[ServiceName, ...] = ("envs", "inference", "trainer")
"""The services that read the base model (``model.dir``)."""


def bring_model(config: SharedConfig) -> None:
    """Syncs the model from ``model.store_prefix`` into ``model.dir`` when one is set."""
    prefix, model_dir = config.model.store_prefix, config.model.dir
    if prefix is None or model_dir is None:
        return
    from services.model_source import sync_model
    from services.objectstore import open_store

    if sync_model(open_store(config.object_store), prefix, model_dir):
        log.info("model synced from %s into %s", prefix, model_dir)
    else:
        log.info("model at %s is the one under %s", model_dir, prefix)


def main(service: ServiceName, model: type[SharedConfig], argv: list[str] | None = None) -> int:
    """Entry point of ``python -m services.<service>``; `model` is the process's config."""
    args = parse_args(service, argv)
    try:
        config = load_service_config(model, args.config)
    except (ValidationError, ValueError, FileNotFoundError) as error:
        print(f"invalid config: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    return run_service(service, config)
