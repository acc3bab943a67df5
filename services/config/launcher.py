"""Settings of `etude run`, the local launcher: how it brings a deployment up on one
machine and builds the base model. Only the whole-deployment config has this section."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from services.config import ServiceName, StrictModel


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
    sft_multifile_tasks: int = Field(
        0,
        ge=0,
        description="Multifile training tasks whose teacher transcripts (services/launcher/"
        "teacher.py: the real harness under envs.harness's multifile budgets, summaries "
        "included) join the SFT data, spread evenly among the synthetic ones; 0: none.",
    )
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up of each stage, in steps.")
    tokens_per_step: int = Field(8192, ge=64, description="Tokens per optimizer step.")
    max_seq_len: int = Field(512, ge=16, description="Longer examples are truncated.")
    sft_max_seq_len: int | None = Field(
        None,
        ge=16,
        description="SFT's max_seq_len where it differs from CPT's (default: max_seq_len): "
        "a transcript context runs up to the harness's context_tokens, and one cut would "
        "lose the summary at its end, so a longer one is refused, not cut.",
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Activation dtype of CPT and SFT (weights are float32 either way). On "
        "this CPU a one-thread float32 step ran about 1.5x faster than bfloat16 autocast.",
    )


class LauncherConfig(StrictModel):
    """`etude run`: how the local launcher brings a deployment up on one machine."""

    model_preset: Literal["tiny", "small"] = Field(
        "small", description="Preset `etude run` creates at model.dir if absent."
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
