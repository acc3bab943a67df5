"""Settings of the evals service: which suites, how often, which pass@k."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from services.config import (
    GrpcServerConfig,
    HttpServerConfig,
    ServiceConfig,
    SharedConfig,
    StrictModel,
)
from services.config.envs import EnvsConfig


class SuiteConfig(StrictModel):
    """Overrides of one suite's defaults (``[evals.suites.<name>]``); unset keeps the suite's."""

    enabled: bool | None = Field(
        None,
        description="The watcher scores every published version on it (RunEval always can); "
        "unset: the suite's own default (on for all but multifile-heldout, whose rollouts are "
        "long).",
    )
    num_tasks: int | None = Field(
        None, ge=1, description="Score the first N tasks of the suite's fixed list; unset: all."
    )
    num_samples: int | None = Field(
        None, ge=1, le=1024, description="K, samples per task, when RunEval does not say."
    )
    seed: int = Field(
        0, ge=0, description="Seed of a generated suite's task list (synthetic-heldout)."
    )
    base_num_tasks: int | None = Field(
        None,
        ge=1,
        description=(
            "Tasks version 0 is scored on (the first N of the same list, at least num_tasks); "
            "unset: num_tasks x evals.base_tasks_multiplier, at most the whole list."
        ),
    )

    @model_validator(mode="after")
    def _base_covers_later_versions(self) -> SuiteConfig:
        if (
            self.base_num_tasks is not None
            and self.num_tasks is not None
            and self.base_num_tasks < self.num_tasks
        ):
            raise ValueError(
                f"base_num_tasks = {self.base_num_tasks} is below num_tasks = {self.num_tasks}: "
                "version 0 is scored on at least the tasks later versions are"
            )
        return self


class EvalsConfig(ServiceConfig):
    """Evaluations of published versions; ready when the reconciler and inference are."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50055), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9105), description="HTTP listener."
    )
    suites: dict[str, SuiteConfig] = Field(
        default_factory=dict,
        description=(
            "Per-suite overrides by suite name; every suite under services/evals/suites is "
            "known, and watched as its entry or else its own default says."
        ),
    )
    watch: bool = Field(True, description="Score published versions as they appear.")
    every_n_versions: int = Field(
        1,
        ge=1,
        description=(
            "Score a version only when it is at least this many past the last one scored; "
            "when behind, the newest version is scored and those in between are skipped."
        ),
    )
    pass_at_k: list[int] = Field(
        default_factory=lambda: [1, 2, 4],
        min_length=1,
        description="k of the unbiased pass@k estimates (a k above a suite's K is left out).",
    )
    priority: int = Field(
        0, ge=-1000, le=1000, description="Priority of eval groups among eval groups."
    )
    eval_timeout_s: float = Field(
        3600.0, gt=0, description="An eval whose groups are not all ready by then fails."
    )
    version_retries: int = Field(
        2,
        ge=0,
        le=10,
        description=(
            "Rounds of re-requests for samples an older version sampled (partly) because "
            "inference had not loaded the version yet; still not the version's alone "
            "after them, a sample is left out of the score and counted."
        ),
    )
    base_tasks_multiplier: int = Field(
        4,
        ge=1,
        le=64,
        description=(
            "Version 0 (the base model, the reference of every gain) is scored on this many "
            "times a suite's num_tasks (the same list's first tasks): its interval over "
            "tasks is then about 1/sqrt(this) of a later version's, half at 4."
        ),
    )
    base_samples_multiplier: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Version 0 takes K x this samples per task (at most 1,024): it narrows the "
            "within-task noise, the part of a gain's interval on the same tasks that "
            "version 0 adds, not the spread between tasks."
        ),
    )
    reuse_base_scores: bool = Field(
        True,
        description=(
            "Version 0's score is kept in the object store (eval-cache/base/) under a key of "
            "the base weights, the suite's tasks, K and pass@k, and [envs]'s harness, rewards "
            "and sandbox limits; a run with the same key takes it instead of sampling again "
            "(the record names the run that sampled it). Off: every run scores version 0."
        ),
    )
    poll_interval_s: float = Field(
        10.0, gt=0, description="The store's latest version is checked this often besides notices."
    )

    @field_validator("pass_at_k")
    @classmethod
    def _ks(cls, ks: list[int]) -> list[int]:
        if any(k < 1 or k > 1024 for k in ks):
            raise ValueError(f"pass_at_k: every k must be in [1, 1024], got {ks}")
        return sorted(set(ks))


class EvalsProcessConfig(SharedConfig):
    """What the evals process reads: the shared sections, ``[evals]`` and ``[envs]`` (for
    the rollouts' settings only)."""

    evals: EvalsConfig = Field(default_factory=EvalsConfig, description="Evals service.")
    envs: EnvsConfig = Field(
        default_factory=EnvsConfig,
        description="Envs service (the evals process reads its rollout settings: they are "
        "part of the key of version 0's kept scores, evals.reuse_base_scores).",
    )
