"""Etude's config schemas: pydantic only, no service code, fast to import.

This module holds the building blocks every section uses (``StrictModel``, the
listeners) and the shared sections every process reads (``SharedConfig``: run, auth,
telemetry, endpoints, redis, model, object store, weights). Each service's own section
and the model its process loads are in ``services.config.<service>``; the whole
deployment (every section, as ``etude run`` and ``etude config show`` read it) is
``services.config.deployment``; reading a TOML file with environment overrides is
``services.config.loading``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ServiceName = Literal["reconciler", "envs", "inference", "trainer", "evals"]
SERVICE_NAMES: tuple[ServiceName, ...] = ("reconciler", "envs", "inference", "trainer", "evals")

MIB = 1024 * 1024
# An identifier on the wire (a task id, a Task.family, ...): letters, digits and ._:/-,
# starting with a letter or digit, at most 256 characters (services.wire.errors checks it).
IDENTIFIER = r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,255}"

DEFAULT_MODEL_DIR = Path(".etude/models/small")
"""The model's directory when ``model.dir`` is unset: where ``etude run`` builds it."""


class GrpcServerConfig(StrictModel):
    """The gRPC listener of one service."""

    host: str = Field("0.0.0.0", description="Address to bind.")
    port: int = Field(ge=1, le=65535, description="Port to bind.")
    max_message_bytes: int = Field(
        64 * MIB, ge=4 * MIB, le=2047 * MIB, description="Largest message sent or received."
    )
    shutdown_grace_s: float = Field(
        10.0, ge=0, le=600, description="On SIGTERM, in-flight calls get this long to finish."
    )
    max_concurrent_rpcs: int | None = Field(
        None, ge=1, description="Calls beyond this answer RESOURCE_EXHAUSTED; unset is no limit."
    )
    max_connection_age_s: float = Field(
        30.0,
        ge=1,
        le=86_400,
        description=(
            "Connections are closed (GOAWAY, ±10 % jitter) after this long, so clients "
            "resolve the Service again and spread over replicas added since."
        ),
    )
    max_connection_age_grace_s: float = Field(
        600.0,
        ge=0,
        le=86_400,
        description=(
            "Calls on a connection closed for its age get this long to finish (a long "
            "generation, a watch); then they end UNAVAILABLE and are retried."
        ),
    )
    tls_cert_file: str | None = Field(None, description="PEM certificate; plaintext when unset.")
    tls_key_file: str | None = Field(None, description="PEM private key for tls_cert_file.")

    @model_validator(mode="after")
    def _tls_pair(self) -> GrpcServerConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "tls_cert_file and tls_key_file go together "
                f"(got tls_cert_file={self.tls_cert_file!r}, tls_key_file={self.tls_key_file!r})"
            )
        return self


class HttpServerConfig(StrictModel):
    """The small HTTP side of a service: /metrics, /healthz, /readyz and a status page."""

    host: str = Field("0.0.0.0", description="Address to bind.")
    port: int = Field(ge=0, le=65535, description="Port to bind; 0 disables the HTTP side.")


class ServiceConfig(StrictModel):
    """What every service's section has: its listeners and how often it checks readiness."""

    grpc: GrpcServerConfig = Field(description="gRPC listener.")
    http: HttpServerConfig = Field(description="HTTP listener.")
    readiness_interval_s: float = Field(
        2.0, gt=0, le=60, description="How often readiness (and dependencies) are re-checked."
    )
    dependency_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Deadline of one dependency readiness check."
    )


class RunConfig(StrictModel):
    """Identity and local state of a run."""

    name: str = Field(
        "local",
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Run name; prefixes Redis keys and object-store paths.",
    )
    state_dir: Path = Field(
        Path(".etude"), description="Local state (logs, models, file:// store) for `etude run`."
    )


class AuthConfig(StrictModel):
    """Bearer-token authentication shared by all services."""

    token: SecretStr | None = Field(
        None, description="Shared token; set it with ETUDE_AUTH__TOKEN rather than in a file."
    )
    required: bool = Field(True, description="Refuse to start without a token.")


class TelemetryConfig(StrictModel):
    """Logging and tracing."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level."
    )
    log_format: Literal["text", "json"] = Field("text", description="json for log collectors.")
    traces_exporter: Literal["none", "otlp", "console", "jsonl"] = Field(
        "none", description="Where spans go: OTLP/gRPC collector, stderr, or a JSON-lines file."
    )
    otlp_endpoint: str = Field(
        "http://127.0.0.1:4317", description="OTLP collector for traces_exporter = 'otlp'."
    )
    traces_file: Path | None = Field(
        None, description="File for traces_exporter = 'jsonl' (one span per line)."
    )

    @model_validator(mode="after")
    def _file_for_jsonl(self) -> TelemetryConfig:
        if self.traces_exporter == "jsonl" and self.traces_file is None:
            raise ValueError("traces_exporter = 'jsonl' needs traces_file (got traces_file = None)")
        return self


class EndpointsConfig(StrictModel):
    """Where each service is reached, as gRPC targets: "host:port" or "dns:///name:port"
    (every address the name resolves to gets calls in turn)."""

    reconciler: str = Field("127.0.0.1:50051", description="Reconciler gRPC target.")
    envs: str = Field("127.0.0.1:50052", description="Envs gRPC target.")
    inference: str = Field("127.0.0.1:50053", description="Inference gRPC target.")
    trainer: str = Field("127.0.0.1:50054", description="Trainer gRPC target.")
    evals: str = Field("127.0.0.1:50055", description="Evals gRPC target.")
    tls_ca_file: Path | None = Field(
        None, description="CA bundle for TLS to other services; plaintext when unset."
    )
    min_resolution_interval_s: float = Field(
        30.0,
        ge=0.1,
        le=3600,
        description=(
            "A client resolves a target again (on a closed connection) at most this often; "
            "with the servers' max_connection_age_s it bounds how soon new replicas get calls."
        ),
    )

    def target(self, service: ServiceName) -> str:
        """The gRPC target of `service`."""
        value: str = getattr(self, service)
        return value


class RedisConfig(StrictModel):
    """Redis, the reconciler's source of truth."""

    url: str = Field(
        "redis://127.0.0.1:6379/0", pattern=r"^rediss?://", description="redis:// or rediss:// URL."
    )


class ModelConfig(StrictModel):
    """The base model: one source that the trainer, inference and envs share."""

    dir: Path | None = Field(
        None,
        description="HF-layout model directory every service reads: the trainer starts from "
        "it, inference serves it, envs tokenizes with it. Unset: .etude/models/small, where "
        "`etude run` builds the model.",
    )
    store_prefix: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        # pydantic's (Rust) regex: `$` is the end of the text, no trailing newline.
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9._=+@,:-]*(/[A-Za-z0-9_][A-Za-z0-9._=+@,:-]*)*$",
        description="Object-store prefix the model is synced from into `dir` when a service "
        "that reads it starts (`etude model push` uploads it there): one copy for every pod "
        "of a cluster. Unset: `dir` already holds the model (a volume, or `etude model init`).",
    )

    @property
    def directory(self) -> Path:
        """The model's directory: ``dir``, or the default when it is unset."""
        return DEFAULT_MODEL_DIR if self.dir is None else self.dir

    @model_validator(mode="after")
    def _somewhere_to_sync(self) -> ModelConfig:
        if self.store_prefix is not None and self.dir is None:
            raise ValueError(
                "model.store_prefix needs model.dir, where to sync the model "
                f"(got store_prefix = {self.store_prefix!r}, dir = None)"
            )
        return self


class ObjectStoreConfig(StrictModel):
    """The object store for weights, rollout records and reports."""

    url: str = Field(
        "file://.etude/store",
        pattern=r"^(file|s3)://",
        description="file://<dir> (embedded default) or s3://<bucket>[/<prefix>].",
    )
    endpoint_url: str | None = Field(None, description="S3 API endpoint (MinIO, moto, ...).")
    region: str | None = Field(None, description="S3 region.")
    max_attempts: int = Field(
        6, ge=1, le=20, description="Tries per request on throttling, 5xx and timeouts."
    )
    max_backoff_s: float = Field(5.0, gt=0, description="Longest wait between tries.")
    connect_timeout_s: float = Field(5.0, gt=0, description="S3 connect timeout.")
    read_timeout_s: float = Field(60.0, gt=0, description="S3 read timeout.")
    multipart_threshold_bytes: int = Field(
        64 * MIB, ge=1024, description="Objects this large are uploaded in parts."
    )
    part_size_bytes: int = Field(
        16 * MIB,
        ge=1024,
        description="Multipart part and ranged-download chunk size (AWS S3 needs >= 5 MiB).",
    )
    max_concurrency: int = Field(8, ge=1, le=64, description="Parallel parts or ranges.")


class WeightsConfig(StrictModel):
    """How policy versions travel from trainer ranks to inference replicas."""

    keyframe_interval: int = Field(
        8, ge=1, le=10_000, description="A full keyframe every this many versions."
    )
    zstd_level: int = Field(1, ge=1, le=22, description="zstd level of the codec.")
    group_bytes: int = Field(
        64 * MIB, ge=1024, description="Tensors are grouped into objects of about this size."
    )
    publish_attempts: int = Field(
        3, ge=1, le=20, description="Tries of a whole version before it is given up."
    )
    shard_wait_s: float = Field(
        600.0, gt=0, description="Shard 0 waits this long for the other shards of a version."
    )
    poll_interval_s: float = Field(
        10.0, gt=0, description="Followers check `latest` this often besides notices."
    )
    concurrency: int = Field(8, ge=1, le=64, description="Parallel object uploads or downloads.")
    keep_last: int = Field(
        2, ge=1, description="Retention keeps the newest keyframe chain and at least this many."
    )
    collect_garbage: bool = Field(
        True, description="Shard 0 deletes versions nobody can need after each publish."
    )


class SharedConfig(StrictModel):
    """The sections every process reads; each process's config adds its own section.

    A process validates these and its own section only: the file's sections of other
    services are left to their processes (services.config.loading).
    """

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

    def redacted_json(self) -> str:
        """The resolved config as JSON, secrets masked, for the start-up log."""
        return self.model_dump_json(indent=None)
