"""Settings of the reconciler service: leases, retries, staleness, priorities, backpressure."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from services.config import (
    GrpcServerConfig,
    HttpServerConfig,
    ServiceConfig,
    SharedConfig,
    StrictModel,
)

GENERATOR_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class MixSource(StrictModel):
    """One generator of a mixed feed, and its share of the feed's positions."""

    generator: str = Field(
        ..., pattern=GENERATOR_PATTERN, description="'module:function' (as the generator kind)."
    )
    weight: int = Field(
        1, ge=1, le=1000, description="Positions this source takes in each cycle of the mix."
    )


class FeederConfig(StrictModel):
    """A task source that keeps a number of groups in flight (single epoch by default)."""

    kind: Literal["jsonl", "generator", "mix"] = Field(
        "jsonl",
        description="A JSON-lines file of Tasks, a generator function, or several generators "
        "interleaved by weight.",
    )
    path: Path | None = Field(
        None, description="jsonl: file of Task messages in protobuf JSON, one per line."
    )
    key: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="jsonl: the same file as an object-store key (read at start; in a "
        "cluster, where no pod shares a filesystem with you). Exactly one of path and key.",
    )
    generator: str | None = Field(
        None,
        pattern=GENERATOR_PATTERN,
        description="generator: 'module:function'; (position, seed) -> Task, or None at the end.",
    )
    mix: list[MixSource] = Field(
        default_factory=list,
        max_length=64,
        description="mix: the generators, each taking `weight` positions of every cycle of "
        "sum(weights), spread evenly; the feed ends when a source ends.",
    )
    seed: int = Field(0, ge=0, description="generator, mix: seed passed to each function.")
    name: str = Field(
        "default", pattern=r"^[a-z0-9-]{1,40}$", description="Names the cursor kept in Redis."
    )
    num_samples: int = Field(4, ge=1, le=1024, description="K: samples per task (group size).")
    target_in_flight: int = Field(
        16, ge=1, description="Keep this many groups submitted but not yet consumed."
    )
    interval_s: float = Field(1.0, gt=0, description="How often the feeder tops up.")

    @model_validator(mode="after")
    def _source(self) -> FeederConfig:
        if self.kind == "jsonl" and (self.path is None) == (self.key is None):
            raise ValueError(
                "feeder kind 'jsonl' needs exactly one of path (a file) and key (an "
                f"object-store key); got path = {self.path}, key = {self.key}"
            )
        if self.key is not None:
            # The one key check, imported here: it brings the wire errors (and gRPC),
            # which a config for `--help` has no need of.
            from services.messages import require_object_key

            require_object_key(self.key, "reconciler.feeder.key")
        if self.kind == "generator" and self.generator is None:
            raise ValueError("feeder kind 'generator' needs generator (got generator = None)")
        if (self.kind == "mix") != bool(self.mix):
            raise ValueError(
                "feeder kind 'mix' needs mix (a list of {generator, weight}), and only it "
                f"takes one; got kind = {self.kind!r} with {len(self.mix)} mix sources"
            )
        generators = [source.generator for source in self.mix]
        if len(set(generators)) != len(generators):
            raise ValueError(f"feeder mix names a generator twice: {generators}")
        return self


class ReconcilerConfig(ServiceConfig):
    """The reconciler: slot state in Redis (see the shared [redis] section)."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50051), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9101), description="HTTP listener."
    )
    lease_ttl_s: float = Field(
        30.0, ge=0.1, le=3600, description="Lease length when a worker does not ask for one."
    )
    max_lease_ttl_s: float = Field(600.0, ge=0.1, description="Longest lease a worker may ask for.")
    max_attempts: int = Field(
        3, ge=1, le=100, description="Attempts (failures or lost leases) before a slot is dead."
    )
    reap_interval_s: float = Field(1.0, gt=0, le=60, description="How often expired leases return.")
    min_complete_samples: int = Field(
        0,
        ge=0,
        description=(
            "A group is ready with this many complete slots once the rest are dead; "
            "0 means all K must complete."
        ),
    )
    max_staleness: int = Field(
        2, ge=0, description="Policy versions a group may lag the trainer; 0 is synchronous."
    )
    stale_policy: Literal["requeue", "downweight", "drop"] = Field(
        "requeue",
        description="Too-stale groups are re-run, trained with a smaller weight, or dropped.",
    )
    stale_decay: float = Field(
        0.5, gt=0, le=1, description="downweight: weight = decay ** (staleness - max_staleness)."
    )
    staleness_anchor: Literal["start", "submit"] = Field(
        "start",
        description=(
            "Count staleness from the group's first lease ('start', so long rollouts are not "
            "starved) or from its submission."
        ),
    )
    priority_mode: Literal["strict", "weighted"] = Field(
        "strict", description="Eval slots always first, or a weighted share (eval_share)."
    )
    eval_share: float = Field(
        0.5, ge=0, le=1, description="weighted: probability a claim looks at eval slots first."
    )
    max_leased_per_version: int = Field(
        0, ge=0, description="Cap on slots leased under one policy version; 0 is no cap."
    )
    max_groups_per_version: int = Field(
        0,
        ge=0,
        description="Training groups started (first leased) under one policy version; 0 is no "
        "cap. With max_staleness = 0 and this equal to the trainer's groups per step, RL is "
        "synchronous: one batch is generated per version, then trained (`etude run --sync`).",
    )
    max_ready_groups: int = Field(
        0, ge=0, description="Stop leasing training slots while this many groups await the trainer."
    )
    committed_retention_s: float = Field(
        86_400.0,
        ge=0,
        description="Keep trained groups, and finished eval groups, this long in Redis; 0 keeps "
        "them.",
    )
    feeder: FeederConfig | None = Field(None, description="Task source run by the reconciler.")

    @model_validator(mode="after")
    def _lease_bounds(self) -> ReconcilerConfig:
        if self.max_lease_ttl_s < self.lease_ttl_s:
            raise ValueError(
                f"max_lease_ttl_s ({self.max_lease_ttl_s}) must be >= lease_ttl_s "
                f"({self.lease_ttl_s})"
            )
        return self


class ReconcilerProcessConfig(SharedConfig):
    """What the reconciler's process reads: the shared sections and ``[reconciler]``."""

    reconciler: ReconcilerConfig = Field(
        default_factory=ReconcilerConfig, description="Reconciler service."
    )
