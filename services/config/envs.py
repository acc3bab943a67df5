"""Settings of the envs service: sandbox limits, rewards, workspaces, the rollout workers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, create_model, model_validator
from pydantic.fields import FieldInfo

from services.config import (
    IDENTIFIER,
    MIB,
    GrpcServerConfig,
    HttpServerConfig,
    ServiceConfig,
    SharedConfig,
    StrictModel,
)


class SandboxConfig(StrictModel):
    """Limits and mounts of one command in the sandbox."""

    cpu_s: int = Field(30, ge=1, le=3600, description="CPU seconds (RLIMIT_CPU).")
    wall_s: float = Field(60.0, gt=0, le=3600, description="Wall clock before the group is killed.")
    memory_bytes: int = Field(1024 * MIB, ge=16 * MIB, description="Address space (RLIMIT_AS).")
    max_processes: int = Field(
        64, ge=1, le=4096, description="Processes of the uid (RLIMIT_NPROC)."
    )
    max_file_bytes: int = Field(
        16 * MIB, ge=1024, description="Largest file written (RLIMIT_FSIZE)."
    )
    max_open_files: int = Field(256, ge=16, le=65536, description="Open files (RLIMIT_NOFILE).")
    max_output_bytes: int = Field(64 * 1024, ge=1024, description="stdout and stderr are cut here.")
    tmp_bytes: int = Field(64 * MIB, ge=MIB, description="Size of the private /tmp (tmpfs).")
    uid: int = Field(
        65534, ge=1, description="Unprivileged uid commands run as when the service is root."
    )
    allow_unsafe_local: bool = Field(
        False, description="Without bubblewrap, run commands unsandboxed (trusted tests only)."
    )
    backend: Literal["bubblewrap", "pod"] = Field(
        "bubblewrap",
        description="bubblewrap: namespaces per command (needs user namespaces in the pod). "
        "pod: the pod is the isolation boundary (a gVisor or Kata runtimeClassName); "
        "commands keep the per-command limits (the uid, rlimits, time, output caps, a "
        "cleared environment) without namespaces. The envs container must run as root "
        "inside such a pod, to drop to `uid`. Chosen here, never a fallback.",
    )


class LengthPenaltyConfig(StrictModel):
    """C(x) and the weights that make x."""

    scale: float = Field(
        0.001,
        ge=0,
        description="Reward part = -scale * C(x); 0 turns it off. The default costs a "
        "two-turn, 100-token rollout about 0.1, a tenth of a solved task.",
    )
    k: float = Field(0.01, gt=0, description="Curvature knee of C.")
    q: float = Field(0.5, gt=0, lt=1, description="Concavity of C (q -> 1: logarithmic).")
    thinking_tokens: float = Field(1.0, ge=0, description="Weight of a thinking token.")
    tool_call_tokens: float = Field(1.0, ge=0, description="Weight of a tool-call token.")
    tool_output_tokens: float = Field(0.1, ge=0, description="Weight of a tool-output token.")
    final_message_tokens: float = Field(1.0, ge=0, description="Weight of a final-message token.")
    tool_calls: float = Field(10.0, ge=0, description="Weight of one tool call.")
    turns: float = Field(10.0, ge=0, description="Weight of one turn.")


class BehaviourConfig(StrictModel):
    """Penalties for habits the report discourages."""

    unfinished_todo: float = Field(0.1, ge=0, description="Per to-do item left open.")
    comment_reasoning: float = Field(0.2, ge=0, description="When comments read like reasoning.")
    comment_reasoning_lines: int = Field(
        2, ge=1, description="Reasoning-like comment lines that trigger the penalty."
    )
    terminal_only: float = Field(0.1, ge=0, description="When only shell commands were used.")


class RewardConfig(StrictModel):
    """How a rollout's reward is made."""

    task_mode: int = Field(
        0,
        ge=0,
        le=2,
        description="RewardMode override (1 all-pass, 2 pass fraction); 0 uses the task's.",
    )
    length: LengthPenaltyConfig = Field(default_factory=LengthPenaltyConfig, description="C(x).")
    behaviour: BehaviourConfig = Field(default_factory=BehaviourConfig, description="Penalties.")


class HarnessBudgets(StrictModel):
    """Budgets of one rollout (a task family may replace any of them)."""

    max_turns: int = Field(8, ge=1, le=1000, description="Generations in a rollout.")
    max_tokens_per_turn: int = Field(256, ge=8, description="Tokens one generation may write.")
    max_total_tokens: int = Field(4096, ge=8, description="Generated tokens in a rollout.")
    context_tokens: int = Field(
        2048, ge=64, description="A context's length; nearing it triggers self-summarization."
    )
    max_summaries: int = Field(2, ge=0, description="Self-summaries before the rollout stops.")
    summary_tokens: int = Field(128, ge=8, description="Tokens a summary may take.")
    max_tool_output_tokens: int = Field(256, ge=8, description="Tool output shown to the model.")


def _unset_by_default(model: type[StrictModel]) -> dict[str, Any]:
    """`model`'s fields as optional ones, unset by default, each with its limits
    (``Optional[...]``: an annotation held as a value takes no ``| None``)."""
    return {
        name: (Optional[info.annotation], FieldInfo.merge_field_infos(info, default=None))  # noqa: UP045
        for name, info in model.model_fields.items()
    }


# A family's own budgets: each HarnessBudgets field, unset by default, with its limits.
FamilyBudgets: type[StrictModel] = create_model(
    "FamilyBudgets",
    __base__=StrictModel,
    __doc__="A task family's own budgets: each field set replaces the harness's.",
    **_unset_by_default(HarnessBudgets),
)


class HarnessConfig(HarnessBudgets):
    """Budgets and sampling of one rollout."""

    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature.")
    command_timeout_s: float = Field(20.0, gt=0, description="Wall clock of one run() call.")
    seeded_sampling: bool = Field(
        True,
        description=(
            "Seed every generation (from the rollout id and call number), so a rollout can be "
            "sampled again. Turn it off with vLLM's CPU backend under concurrent long prompts: "
            "a seeded prompt prefilled in chunks kills its engine ('CPU Generator does not use "
            "offset')."
        ),
    )
    require_finish: bool = Field(
        False,
        description=(
            "A message without a tool call is answered with a reminder instead of ending the "
            "rollout (the rollout then ends on finish or a budget)."
        ),
    )
    families: dict[str, FamilyBudgets] = Field(
        default_factory=dict,
        description="Budgets of a task family (by Task.family) where they differ from these: "
        "work that must be summarized needs more turns and tokens than one context holds.",
    )

    @model_validator(mode="after")
    def _family_names(self) -> HarnessConfig:
        for family in self.families:
            # A Task.family is an identifier on the wire.
            if not re.fullmatch(IDENTIFIER, family):
                raise ValueError(
                    f"harness.families: {family!r} is not a family name (1-256 letters, "
                    "digits and '._:/-', starting with a letter or digit)"
                )
        return self

    def for_family(self, family: str) -> HarnessConfig:
        """These settings with `family`'s own budgets in place (and no family table)."""
        budgets = self.families.get(family)
        update: dict[str, object] = {"families": {}}
        if budgets is not None:
            update |= budgets.model_dump(exclude_none=True)
        return self.model_copy(update=update)


class EnvsConfig(ServiceConfig):
    """Rollout workers and the sandbox API; ready when the reconciler and inference are."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50052), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9102), description="HTTP listener."
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Sandbox limits.")
    workspaces_dir: Path | None = Field(
        None,
        description=(
            "Where workspaces and snapshots live (default: <tmp>/etude-workspaces-<run.name>); "
            "every directory above it must be traversable by the sandbox uid."
        ),
    )
    workers: int = Field(
        0, ge=0, le=256, description="Rollouts this process runs at once; 0 serves only the API."
    )
    lease_ttl_s: float = Field(
        120.0, gt=0, description="Lease asked for per slot (renewed every third of it)."
    )
    tokenizer_dir: Path | None = Field(
        None, description="Tokenizer of the served model (default: model.dir)."
    )
    harness: HarnessConfig = Field(default_factory=HarnessConfig, description="Rollout budgets.")
    rewards: RewardConfig = Field(default_factory=RewardConfig, description="Reward parts.")


class EnvsProcessConfig(SharedConfig):
    """What an envs process reads: the shared sections and ``[envs]``."""

    envs: EnvsConfig = Field(default_factory=EnvsConfig, description="Envs service.")
