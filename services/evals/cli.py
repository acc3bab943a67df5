"""`etude evals`: the eval report of a run, from the results in the object store.

    etude evals report --run R --out DIR [--config FILE]

writes ``DIR/index.html`` (tables and plots), one PNG per metric and ``results.json``.
Only light modules are imported here; the store, the records and matplotlib load inside
the command, so `etude --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

evals_app = typer.Typer(help="Eval results and reports.", no_args_is_help=True)


@evals_app.command("report")
def report(
    out: Annotated[Path, typer.Option(help="Directory to write index.html, PNGs and JSON to.")],
    run: Annotated[
        str | None, typer.Option(help="Run name (default: the config's run.name).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML run config (its object_store).")
    ] = None,
) -> None:
    """Write the HTML report of every eval of a run: plots by version, per-task tables."""
    from pydantic import ValidationError

    from services.config.evals import EvalsProcessConfig
    from services.config.loading import load_service_config
    from services.evals.report import render
    from services.evals.results import discover, read_record
    from services.objectstore import open_store

    try:
        settings = load_service_config(EvalsProcessConfig, config)
    except (ValidationError, ValueError, FileNotFoundError) as error:
        typer.echo(f"invalid config: {error}", err=True)
        raise typer.Exit(2) from error
    run_name = run or settings.run.name
    store = open_store(settings.object_store)
    found = discover(store, run_name)
    if not found:
        typer.echo(f"no eval results for run {run_name!r} in {settings.object_store.url}", err=True)
        raise typer.Exit(1)
    records = {
        suite: [read_record(store, key)[0] for _, key in sorted(keys.items())]
        for suite, keys in found.items()
    }
    files = render(run_name, records)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    counts = ", ".join(f"{suite}: {len(rs)} versions" for suite, rs in sorted(records.items()))
    typer.echo(f"{out / 'index.html'} ({counts})")
