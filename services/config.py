"""Config building blocks every service shares: listeners and the shared sections.

The whole-deployment model and the TOML/env loader are in ``services.run_config``;
each service's own section is in ``services/<svc>/config.py``. Pydantic only:
importing this is fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ServiceName = Literal["reconciler", "envs", "inference", "trainer", "evals"]
SERVICE_NAMES: tuple[ServiceName, ...] = ("reconciler", "envs", "inference", "trainer", "evals")

MIB = 1024 * 1024


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
        "it, inference serves it, envs tokenizes with it. Unset: inference.engine.model_dir.",
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


class BaseModelConfig(StrictModel):
    """How `etude run` builds the base model: factory model, CPT, then SFT (see
    services/launcher/base_model.py)."""

    seed: int = Field(0, ge=0, description="Seed of the factory model, the corpus and the tasks.")
    cpt_steps: int = Field(150, ge=0, description="Continued-pretraining steps on the corpus.")
    cpt_lr: float = Field(1e-3, gt=0, le=1, description="AdamW learning rate of CPT.")
    sft_steps: int = Field(300, ge=0, description="SFT steps on agent transcripts.")
    sft_lr: float = Field(5e-4, gt=0, le=1, description="AdamW learning rate of SFT.")
    sft_tasks: int = Field(
        4000, ge=1, description="Synthetic training tasks whose transcripts make the SFT data."
    )
    sft_flawed_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of SFT transcripts whose solution prints its result instead of "
        "returning it: an imperfect teacher, as demonstration data is. Imitation learns the "
        "habit; RL on test results can unlearn it. 0 gives a flawless teacher.",
    )
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up of each stage, in steps.")
    tokens_per_step: int = Field(8192, ge=64, description="Tokens per optimizer step.")
    max_seq_len: int = Field(512, ge=16, description="Longer examples are truncated.")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Activation dtype of CPT and SFT (weights are float32 either way). On "
        "this CPU a one-thread float32 step ran about 1.5x faster than bfloat16 autocast.",
    )


class LauncherConfig(StrictModel):
    """`etude run`: how the local launcher brings a deployment up on one machine."""

    model_preset: Literal["tiny", "small"] = Field(
        "small", description="Preset `etude run` creates at inference.engine.model_dir if absent."
    )
    start_redis: bool = Field(
        True, description="Start a private redis-server when none answers at redis.url."
    )
    ready_timeout_s: float = Field(
        600.0, gt=0, description="Give up when the services are not all ready after this long."
    )
    max_restarts: int = Field(
        5, ge=0, le=1000, description="A service that exits is restarted up to this many times."
    )
    restart_backoff_s: float = Field(
        1.0, gt=0, le=60, description="Wait before the first restart; doubled each time (<= 30 s)."
    )
    train_timeout_s: float = Field(
        7200.0, gt=0, description="Give up when the trainer's job is not done after this long."
    )
    stop_grace_s: float = Field(
        20.0, gt=0, description="After SIGTERM, a process gets this long before SIGKILL."
    )
    base_model: BaseModelConfig = Field(
        default_factory=BaseModelConfig, description="Building the base model (CPT + SFT)."
    )
    cpu_affinity: dict[
        ServiceName, Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    ] = Field(
        default_factory=dict,
        description="CPUs a service's processes may run on, e.g. {inference = [0], trainer = "
        "[1]}: dedicated cores, as a cluster gives inference and the trainer their own "
        "devices. Unlisted services run anywhere; empty keeps every service unpinned.",
    )
