"""The `etude` command. Imports stay inside the commands: `etude --help` is instant."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer

from services.envs.cli import envs_app
from services.evals.cli import evals_app

if TYPE_CHECKING:
    from services.config import ServiceName
    from services.config.deployment import EtudeConfig
    from services.model_factory.presets import PresetName

app = typer.Typer(
    help="Etude: asynchronous RL for MoE coding agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Make and inspect models.", no_args_is_help=True)
config_app = typer.Typer(help="Inspect run configs.", no_args_is_help=True)
tasks_app = typer.Typer(help="Make task sets for the feeder.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(config_app, name="config")
app.add_typer(tasks_app, name="tasks")
app.add_typer(envs_app, name="envs")
app.add_typer(evals_app, name="evals")

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML run config (configs/*.toml).")
]


def _load(config: Path | None) -> EtudeConfig:
    from pydantic import ValidationError

    from services.config.deployment import load_config

    try:
        return load_config(config)
    except (ValidationError, ValueError, FileNotFoundError) as error:
        typer.echo(f"invalid config: {error}", err=True)
        raise typer.Exit(2) from error


@app.command()
def serve(
    service: Annotated[str, typer.Argument(help="reconciler | envs | inference | trainer | evals")],
    config: ConfigOption = None,
) -> None:
    """Run one service in this process (what each container runs)."""
    from pydantic import ValidationError

    from services.config import SERVICE_NAMES
    from services.config.deployment import PROCESS_CONFIGS
    from services.config.loading import load_service_config
    from services.process import run_service

    if service not in SERVICE_NAMES:
        typer.echo(f"unknown service {service!r}; known: {', '.join(SERVICE_NAMES)}", err=True)
        raise typer.Exit(2)
    name = cast("ServiceName", service)
    try:
        settings = load_service_config(PROCESS_CONFIGS[name], config)
    except (ValidationError, ValueError, FileNotFoundError) as error:
        typer.echo(f"invalid config: {error}", err=True)
        raise typer.Exit(2) from error
    raise typer.Exit(run_service(name, settings))


@app.command()
def run(
    config: ConfigOption = Path("configs/local.toml"),
    exit_when_ready: Annotated[
        bool, typer.Option(help="Stop everything once all services are ready (a smoke check).")
    ] = False,
    fresh: Annotated[
        bool,
        typer.Option(help="Forget the run (Redis keys, checkpoints, weights, evals) first."),
    ] = False,
    sync: Annotated[
        bool,
        typer.Option(help="Synchronous RL: one batch generated per version, then trained."),
    ] = False,
    rebuild_model: Annotated[
        bool,
        typer.Option(
            help="Delete the base model and its stages and build them again (needs --fresh)."
        ),
    ] = False,
) -> None:
    """The main job: base model, services, async RL with evals, report; Ctrl-C stops it.

    Running it again resumes the run (trainer checkpoint, reconciler state, data cursor)
    unless --fresh. Without a trainer job (`\\[trainer.job]`) in the config it only
    brings the services up.
    """
    from services.launcher.run import run_local

    code = run_local(
        _load(config),
        config,
        exit_when_ready=exit_when_ready,
        fresh=fresh,
        sync=sync,
        rebuild_model=rebuild_model,
    )
    raise typer.Exit(code)


@model_app.command("init")
def model_init(
    preset: Annotated[str, typer.Option(help="tiny (tests, < 2M) | small (demo, 10-30M)")],
    out: Annotated[Path, typer.Option(help="Directory to write the model to.")],
    seed: Annotated[int, typer.Option(help="Seed of the corpus and the weights.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing directory.")] = False,
) -> None:
    """Write a Qwen3-MoE checkpoint and a BPE tokenizer trained on a generated code corpus."""
    from services.model_factory.build import init_model
    from services.model_factory.presets import PRESETS

    if preset not in PRESETS:
        typer.echo(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}", err=True)
        raise typer.Exit(2)
    try:
        card = init_model(
            cast("PresetName", preset), out, seed=seed, overwrite=overwrite, progress=typer.echo
        )
    except FileExistsError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(1) from error
    parameters = card["parameters"]
    typer.echo(f"{preset}: {parameters['total']:,} parameters ({parameters['active']:,} active)")


@model_app.command("fit-mtp")
def model_fit_mtp(
    model_dir: Annotated[Path, typer.Option("--dir", help="The HF-layout model directory.")],
    out: Annotated[Path, typer.Option(help="The mtp.safetensors file to write.")],
    steps: Annotated[int, typer.Option(help="AdamW steps of self-distillation.")] = 200,
    heads: Annotated[int, typer.Option(help="MTP heads to fit.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the heads and the corpus.")] = 0,
) -> None:
    """Fit MTP heads to a frozen model by self-distillation on the factory corpus."""
    from services.trainer.mtp_distill import distill_heads

    losses = distill_heads(
        model_dir,
        out,
        steps=steps,
        num_heads=heads,
        seed=seed,
        progress=lambda step, loss: typer.echo(f"step {step + 1}/{steps}: loss {loss:.4f}")
        if (step + 1) % 20 == 0 or step + 1 == steps
        else None,
    )
    typer.echo(f"{out}: {heads} head(s), loss {losses[0]:.4f} -> {losses[-1]:.4f}")


@model_app.command("draft")
def model_draft(
    model_dir: Annotated[Path, typer.Option("--dir", help="The policy's model directory.")],
    out: Annotated[Path, typer.Option(help="The draft directory to write.")],
    mtp: Annotated[
        Path | None, typer.Option(help="MTP heads (default: <dir>/mtp.safetensors).")
    ] = None,
    head: Annotated[int, typer.Option(help="Which head (0-based) drafts.")] = 0,
) -> None:
    """Export an MTP head as a vLLM speculative-decoding draft (inference.engine.draft_dir)."""
    from services.inference.mtp_draft import export_draft

    try:
        export_draft(model_dir, out, mtp_file=mtp, head=head)
    except (FileNotFoundError, ValueError) as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from error
    typer.echo(f"{out}: head {head} of {mtp or model_dir / 'mtp.safetensors'} as a draft")


@model_app.command("push")
def model_push(
    model_dir: Annotated[Path, typer.Option("--dir", help="The HF-layout model directory.")],
    prefix: Annotated[
        str | None,
        typer.Option(help="Object-store prefix (default: the config's model.store_prefix)."),
    ] = None,
    config: ConfigOption = None,
) -> None:
    """Upload a model where every service syncs it from (model.store_prefix)."""
    from services.config import ModelConfig
    from services.model_source import ModelSourceError, fingerprint, push_model
    from services.objectstore import open_store

    resolved = _load(config)
    prefix = prefix or resolved.model.store_prefix
    if prefix is None:
        typer.echo("no --prefix and no model.store_prefix in the config", err=True)
        raise typer.Exit(2)
    try:
        ModelConfig(dir=model_dir, store_prefix=prefix)  # the prefix the services accept
        size = push_model(open_store(resolved.object_store), model_dir, prefix)
    except (ValueError, ModelSourceError) as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from error
    typer.echo(f"{model_dir} ({fingerprint(model_dir)}): {size:,} bytes under {prefix}")


@config_app.command("show")
def config_show(config: ConfigOption = None) -> None:
    """Print the resolved config (file + ETUDE_* environment) as JSON."""
    typer.echo(_load(config).model_dump_json(indent=2))


@tasks_app.command("export")
def tasks_export(
    count: Annotated[int, typer.Option(min=1, help="How many tasks (positions 0..count-1).")],
    generator: Annotated[
        str, typer.Option(help="'module:function', (position, seed) -> Task | None.")
    ] = "services.families.synthetic:task_at",
    seed: Annotated[int, typer.Option(min=0, help="Seed passed to the generator.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Write the JSON lines to this file.")] = None,
    key: Annotated[
        str | None,
        typer.Option(help="Write them to this key of the config's object store instead."),
    ] = None,
    config: ConfigOption = None,
) -> None:
    """Write a generator's tasks as JSON lines: the file a jsonl feeder reads, by path or,
    in a cluster, by object-store key (reconciler.feeder.key)."""
    from google.protobuf import json_format
    from pydantic import ValidationError

    from services.config.reconciler import FeederConfig
    from services.reconciler.feeders import build_feeder

    if (out is None) == (key is None):
        typer.echo("give exactly one of --out and --key", err=True)
        raise typer.Exit(2)
    try:
        feeder = build_feeder(FeederConfig(kind="generator", generator=generator, seed=seed))
    except (ValidationError, ImportError, AttributeError) as error:
        typer.echo(f"generator {generator!r}: {error}", err=True)
        raise typer.Exit(2) from error
    tasks = feeder.tasks_from(0, count)
    text = "".join(json_format.MessageToJson(task, indent=None) + "\n" for task in tasks)
    if out is not None:
        out.write_text(text)
        where = str(out)
    else:
        from services.messages import require_object_key
        from services.objectstore import open_store

        assert key is not None
        try:
            require_object_key(key, "--key")
        except ValueError as error:
            typer.echo(str(error), err=True)
            raise typer.Exit(2) from error
        open_store(_load(config).object_store).put(key, text.encode())
        where = f"object {key}"
    typer.echo(f"{len(tasks)} tasks ({generator}, seed {seed}) -> {where}")


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="A benchmark name, or 'all'.")],
    quick: Annotated[bool, typer.Option(help="Fewer repetitions (for smoke checks).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per benchmark.")] = False,
) -> None:
    """Measure figures against a same-run baseline (see services/bench)."""
    from services.bench import BENCHMARKS, BenchSettingError, load

    if as_json:
        # Standard output is the JSON alone: vLLM logs to it unless told otherwise (its
        # engine processes inherit the setting).
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    names = sorted(BENCHMARKS) if name == "all" else [name]
    all_ok = True
    for bench_name in names:
        try:
            run_bench = load(bench_name)
        except KeyError as error:
            typer.echo(str(error.args[0]), err=True)
            raise typer.Exit(2) from error
        try:
            result = run_bench(quick).to_json(bench_name)
        except BenchSettingError as error:
            typer.echo(f"{bench_name}: {error}", err=True)
            raise typer.Exit(2) from error
        all_ok &= bool(result["ok"])
        if as_json:
            typer.echo(json.dumps(result))
        else:
            typer.echo(json.dumps(result, indent=2))
    raise typer.Exit(0 if all_ok else 1)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="etude")


if __name__ == "__main__":
    main()
