"""Settings of the envs service: sandbox limits, workspaces, the rollout workers."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.config import GrpcServerConfig, HttpServerConfig, ServiceConfig, StrictModel
from services.envs.rewards import RewardConfig
from services.envs.sandbox import SandboxConfig


class HarnessConfig(StrictModel):
    """Budgets and sampling of one rollout."""

    max_turns: int = Field(8, ge=1, le=1000, description="Generations in a rollout.")
    max_tokens_per_turn: int = Field(256, ge=8, description="Tokens one generation may write.")
    max_total_tokens: int = Field(4096, ge=8, description="Generated tokens in a rollout.")
    context_tokens: int = Field(
        2048, ge=64, description="A context's length; nearing it triggers self-summarization."
    )
    max_summaries: int = Field(2, ge=0, description="Self-summaries before the rollout stops.")
    summary_tokens: int = Field(128, ge=8, description="Tokens a summary may take.")
    max_tool_output_tokens: int = Field(256, ge=8, description="Tool output shown to the model.")
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
        None, description="Tokenizer of the served model (default: inference.engine.model_dir)."
    )
    harness: HarnessConfig = Field(default_factory=HarnessConfig, description="Rollout budgets.")
    rewards: RewardConfig = Field(default_factory=RewardConfig, description="Reward parts.")
