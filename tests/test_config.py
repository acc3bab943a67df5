"""Run configs: every shipped file loads, overrides apply, bad values name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.config import SERVICE_NAMES, ServiceName
from services.config.deployment import PROCESS_CONFIGS, EtudeConfig, load_config
from services.config.inference import InferenceProcessConfig
from services.config.loading import apply_env_overrides, load_service_config
from services.config.reconciler import ReconcilerProcessConfig

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml"))


def test_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"local.toml", "cluster.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path, environ={})
    assert config.run.name
    ports = [
        getattr(config, s).grpc.port
        for s in ("reconciler", "envs", "inference", "trainer", "evals")
    ]
    assert len(set(ports)) == 5 or path.name != "local.toml"


def test_the_cluster_config_is_a_complete_job_on_one_model() -> None:
    """A trainer job, a task source a pod can reach (the bucket), eval suites, and one
    model that every pod syncs from the bucket."""
    config = load_config(CONFIGS[0].parent / "cluster.toml", environ={})
    job = config.trainer.job
    assert job is not None and job.phase == "rl" and job.checkpoint.location == "object_store"
    feeder = config.reconciler.feeder
    assert feeder is not None and feeder.kind == "jsonl" and feeder.key and feeder.path is None
    assert config.evals.suites
    assert config.model.dir is not None and config.model.store_prefix
    assert config.inference.engine.model_dir == config.model.dir


def test_environment_overrides_any_field(tmp_path: Path) -> None:
    config = load_config(
        Path(CONFIGS[0].parent / "local.toml"),
        environ={
            "ETUDE_AUTH__TOKEN": "s3cret",
            "ETUDE_INFERENCE__GRPC__PORT": "6000",
            "ETUDE_INFERENCE__ENGINE__MAX_MODEL_LEN": "1024",
            "ETUDE_REDIS__URL": "redis://example:6380/1",
            "UNRELATED": "x",
        },
    )
    assert config.auth.token is not None and config.auth.token.get_secret_value() == "s3cret"
    assert config.inference.grpc.port == 6000
    assert config.inference.engine.max_model_len == 1024
    assert config.redis.url == "redis://example:6380/1"
    assert "s3cret" not in config.redacted_json()


def test_override_into_a_scalar_is_an_error() -> None:
    with pytest.raises(ValueError, match="ETUDE_REDIS__URL__X"):
        apply_env_overrides({"redis": {"url": "redis://x"}}, {"ETUDE_REDIS__URL__X": "1"})


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[inference.engine]\nmax_model_len = 'long'\n", "max_model_len"),
        ("[reconciler]\ngrpc = { port = 70000 }\n", "port"),
        ("[reconciler]\nunknown_key = 1\n", "unknown_key"),
        ("[redis]\nurl = 'http://not-redis'\n", "url"),
        ("[telemetry]\ntraces_exporter = 'jsonl'\n", "traces_file"),
        ("[run]\nname = 'Has Spaces'\n", "name"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValidationError) as error:
        load_config(path, environ={})
    assert field in str(error.value)


def test_tls_needs_both_files(tmp_path: Path) -> None:
    path = tmp_path / "tls.toml"
    path.write_text("[trainer]\ngrpc = { port = 1, tls_cert_file = 'c.pem' }\n")
    with pytest.raises(ValidationError, match=r"tls_cert_file and tls_key_file"):
        load_config(path, environ={})


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.toml"):
        load_config(tmp_path / "nope.toml", environ={})


# evals reads [envs]: its rollout settings are part of the key of version 0's kept scores.
ALSO_READS: dict[str, tuple[str, ...]] = {"evals": ("envs",)}


@pytest.mark.parametrize("service", SERVICE_NAMES)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_in_every_process(path: Path, service: ServiceName) -> None:
    whole = load_config(path, environ={})
    config = load_service_config(PROCESS_CONFIGS[service], path, environ={})
    assert set(type(config).model_fields) <= set(EtudeConfig.model_fields)
    assert getattr(config, service) == getattr(whole, service)
    assert config.model == whole.model and config.endpoints == whole.endpoints
    # Besides its own, a process reads only the sections listed here, as the file has them.
    read = {service, *ALSO_READS.get(service, ())}
    assert {"launcher", *SERVICE_NAMES} & set(type(config).model_fields) == read
    assert all(getattr(config, section) == getattr(whole, section) for section in read)


def test_a_process_leaves_other_services_sections_to_them(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[evals]\nevery_n_versions = 0\n\n[launcher]\nnosuch = 1\n")
    config = load_service_config(
        ReconcilerProcessConfig, path, environ={"ETUDE_RECONCILER__MAX_STALENESS": "5"}
    )
    assert config.reconciler.max_staleness == 5
    with pytest.raises(ValidationError, match="every_n_versions"):
        load_config(path, environ={})
    path.write_text("[reconciler]\nmax_staleness = 1\n\n[nosuch]\nfield = 1\n")
    with pytest.raises(ValidationError, match="nosuch"):
        load_service_config(ReconcilerProcessConfig, path, environ={})


def test_the_inference_process_keeps_the_one_model_rule(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\ndir = "/m"\n')
    config = load_service_config(InferenceProcessConfig, path, environ={})
    assert config.inference.engine.model_dir == Path("/m")
    # Without model.dir the trainer and envs would read the default: a second model.
    path.write_text('[inference.engine]\nmodel_dir = "/elsewhere"\n')
    with pytest.raises(ValueError, match=r"model\.dir .* name two models"):
        load_service_config(InferenceProcessConfig, path, environ={})
    # Every process refuses it, not only the one that reads the inference section.
    for service in SERVICE_NAMES:
        with pytest.raises(ValueError, match=r"model\.dir \(\S+, its default\) and "):
            load_service_config(PROCESS_CONFIGS[service], path, environ={})
    # Repeating model.dir there is allowed.
    path.write_text('[model]\ndir = "/m"\n[inference.engine]\nmodel_dir = "/m"\n')
    assert load_service_config(PROCESS_CONFIGS["trainer"], path, environ={}).model.dir == Path("/m")
