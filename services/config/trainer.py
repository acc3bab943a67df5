"""Settings of the trainer service and of the training job it runs (pydantic only).

Without ``[trainer.job]`` the service only answers status and lists checkpoints. With
it, the service trains: ``phase = "cpt"`` or ``"sft"`` on a token stream
(``[trainer.job.data]``), or ``phase = "rl"`` on the groups the reconciler hands out
(``[trainer.job.rl]``). See docs/trainer.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.config import (
    GrpcServerConfig,
    HttpServerConfig,
    ServiceConfig,
    SharedConfig,
    StrictModel,
)


class ModelSettings(StrictModel):
    """The model a job starts from and how it computes."""

    model_dir: Path | None = Field(
        None,
        description="HF model directory to start from; unset means model.dir "
        "(the model inference serves).",
    )
    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Activation dtype; weights stay float32 master copies. 'auto': bfloat16 "
        "on an accelerator and on a CPU with native bf16 GEMMs (AVX-512/AMX), float32 on "
        "other CPUs, where torch's bf16 GEMM is a scalar fallback (about 8x slower).",
    )
    # The fields of services.trainer.precision.PrecisionConfig the job sets; importing that
    # package here would import torch into every service's config parsing.
    experts_precision: Literal["auto", "bf16", "nvfp4_fwd_mxfp8_bwd", "fp32"] = Field(
        "auto",
        description="Recipe of the expert GEMMs: 'bf16', 'nvfp4_fwd_mxfp8_bwd' (the report's "
        "NVFP4-variant forward, MXFP8 backward), 'fp32', or 'auto' (that of the compute "
        "dtype: fp32 for float32, bf16 for bfloat16).",
    )
    experts_backend: Literal["auto", "emulated", "blackwell"] = Field(
        "auto", description="Kernel backend of the quantized recipe (see docs/precision.md)."
    )
    numerics: Literal["eager", "fused"] = Field(
        "eager",
        description="Where bf16 activations round: 'eager' after every operation, as "
        "transformers does (bit-identical to it); 'fused' once per fused kernel, as vLLM's "
        "CPU kernels do (add+norm, RoPE, SwiGLU and the top-k combine in float32), which "
        "brings the trainer's logprobs closer to inference's (docs/trainer.md). 'fused' "
        "needs the bf16 or fp32 expert recipe.",
    )
    num_mtp_heads: int = Field(
        0, ge=0, le=4, description="Multi-token-prediction heads trained by self-distillation."
    )
    mtp_loss_coef: float = Field(0.1, ge=0, description="Weight of the MTP distillation loss.")
    activation_checkpointing: bool = Field(
        False,
        description="Keep only each decoder layer's input in the forward and recompute the "
        "layer in backward: activation memory of one tensor per layer, for one more forward "
        "of compute (the step's results are the same bit for bit). For long sequences that "
        "would not fit otherwise; it costs time on a CPU (docs/benchmarks.md, trainer).",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer, policy and reference (Inductor). Off "
        "by default: on CPU attention loops over the microbatch's sequences in Python, so "
        "every new set of sequence lengths compiles the layers again (docs/benchmarks.md, "
        "trainer, measures it). Tested in one process only.",
    )

    @model_validator(mode="after")
    def _fused_needs_plain_experts(self) -> ModelSettings:
        if self.numerics == "fused" and self.experts_precision == "nvfp4_fwd_mxfp8_bwd":
            raise ValueError(
                "model.numerics 'fused' needs experts_precision bf16, fp32 or auto, "
                "not nvfp4_fwd_mxfp8_bwd"
            )
        return self


class ReplayConfig(StrictModel):
    """Router replay: route each token to the experts inference used."""

    mode: Literal["when_present", "required", "off"] = Field(
        "when_present",
        description="'when_present' replays rollouts that carry routed experts and routes the "
        "others with the router (counted); 'required' skips rollouts without them; 'off' "
        "never replays.",
    )
    min_prob_ratio: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Plausibility filter: a replayed expert whose router probability is below "
        "this fraction of the router's k-th largest probability is replaced.",
    )


class OptimizerConfig(StrictModel):
    """AdamW, or Muon for the hidden matrices (attention projections, expert stacks) with
    AdamW for the rest."""

    name: Literal["adamw", "muon"] = Field("adamw", description="Optimizer family.")
    lr: float = Field(1e-6, gt=0, le=1, description="AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (both optimizers).")
    muon_lr: float = Field(0.02, gt=0, le=1, description="Muon learning rate (name = 'muon').")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon momentum.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in steps.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables it.")

    @model_validator(mode="after")
    def _betas(self) -> OptimizerConfig:
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas}")
        return self


class RLConfig(StrictModel):
    """The RL step: Dr. GRPO with k1 KL and truncated importance sampling."""

    consumer_id: str = Field(
        "trainer", pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$", description="PullBatch consumer."
    )
    groups_per_step: int = Field(8, ge=1, le=4096, description="Groups pulled per step.")
    pull_wait_s: float = Field(
        5.0,
        ge=0,
        le=600,
        description="PullBatch waits this long for a full batch, then takes what is ready.",
    )
    generation_budget_tokens: int = Field(
        8192,
        ge=1,
        description="Dr. GRPO's constant: per-rollout token sums are divided by this, never by "
        "the rollout's own length.",
    )
    importance_cap: float = Field(
        2.0,
        ge=1,
        description="c in the truncated importance ratio min(pi_theta / pi_behaviour, c).",
    )
    kl_coef: float = Field(
        0.001, ge=0, description="Weight of the per-token k1 KL penalty; 0 skips the reference."
    )
    reference_refresh_steps: int = Field(
        0, ge=0, description="Copy the policy into the reference every this many steps; 0 never."
    )
    microbatch_tokens: int = Field(
        16_384, ge=16, description="Tokens per forward/backward; a step accumulates microbatches."
    )
    skip_uniform_task_groups: bool = Field(
        False,
        description="Leave out of the gradient a group whose rollouts all earned the same task "
        "reward (all solved or all failed; counted as skipped_group_uniform_task_reward): its "
        "advantages are only length and behaviour differences. The group is still consumed "
        "by the step; raise groups_per_step to keep the informative groups per step.",
    )


class DataConfig(StrictModel):
    """Training data of the cpt and sft phases."""

    kind: Literal["corpus", "jsonl"] = Field(
        "corpus",
        description="'corpus': the model factory's generated code corpus (cpt). 'jsonl': one "
        "JSON object per line, {'text': ...} (cpt) or {'prompt': ..., 'completion': ...} (sft).",
    )
    path: Path | None = Field(None, description="The JSON-lines file (kind = 'jsonl').")
    seed: int = Field(0, ge=0, description="Corpus seed (kind = 'corpus').")
    tokens_per_step: int = Field(
        4096, ge=16, description="Tokens (with padding-free packing) per step."
    )
    max_seq_len: int = Field(512, ge=8, description="Longer examples are truncated to this.")

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> DataConfig:
        if self.kind == "jsonl" and self.path is None:
            raise ValueError("data.kind = 'jsonl' needs data.path (got path = None)")
        if self.max_seq_len > self.tokens_per_step:
            raise ValueError(
                f"data.max_seq_len ({self.max_seq_len}) must not exceed data.tokens_per_step "
                f"({self.tokens_per_step})"
            )
        return self


class CheckpointConfig(StrictModel):
    """When and where the job writes checkpoints (torch.distributed.checkpoint)."""

    interval_steps: int = Field(
        1,
        ge=0,
        description="Checkpoint every this many steps; 0 only on request and at the end. RL "
        "commits pulled groups to the reconciler only after they are in a checkpoint.",
    )
    keep_last: int = Field(3, ge=1, description="Periodic checkpoints kept (tagged ones stay).")
    location: Literal["auto", "local", "object_store"] = Field(
        "auto",
        description="Where checkpoints live. 'local': a directory (trainer.checkpoint_dir, or "
        "<run.state_dir>/checkpoints/<run.name>) that every rank must share. 'object_store': "
        "objects under <prefix>/<run.name>/ in [object_store], manifest last, restorable on "
        "any node (the local directory only stages saves and resumes). 'auto': the object "
        "store when object_store.url is s3://, else local.",
    )
    prefix: str = Field(
        "checkpoints",
        min_length=1,
        description="Key prefix of checkpoints in the object store: a relative path without "
        "'.', '..' or empty parts; a run's are under <prefix>/<run.name>/.",
    )

    @field_validator("prefix")
    @classmethod
    def _relative_key(cls, prefix: str) -> str:
        parts = prefix.split("/")
        if prefix.startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise ValueError(
                f"checkpoint.prefix {prefix!r} must be a relative key without '.', '..' or "
                "empty parts, e.g. 'checkpoints'"
            )
        return prefix


class PackingConfig(StrictModel):
    """Global sequence packing: a sequence of L tokens costs ``a * L + b * L**2``."""

    cost_per_token: float = Field(
        1.0,
        gt=0,
        description="a: the linear part of a sequence's cost (projections, experts), per token.",
    )
    cost_per_token_pair: float = Field(
        4e-5,
        ge=0,
        description="b: the quadratic part (causal attention), per token pair, in the units of "
        "a. `etude bench packing` measures a and b on a model; the default suits a "
        "d_model of about 4096 (b / a ~ 1 / (6 d_model)).",
    )
    calibrate: bool = Field(
        False,
        description="Measure a and b at start-up (a timed forward + backward of one decoder "
        "layer at several lengths, on rank 0) instead of using the two settings.",
    )


class DistConfig(StrictModel):
    """How the job is laid out over the processes torchrun starts (docs/distributed.md).

    Dense weights are sharded (FSDP2) over every rank, a dp x cp mesh; experts are sharded
    over an ``ep`` axis formed from the same ranks. The degrees are checked against the
    world size and the model at start-up, before any collective.
    """

    dp: int = Field(0, ge=0, le=65536, description="Data-parallel degree; 0 means world size / cp.")
    cp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Context-parallel degree: each sequence is cut into 2 * cp chunks and rank "
        "i of a cp group holds chunks i and 2 cp - 1 - i (balanced causal attention).",
    )
    ep: int = Field(
        1,
        ge=1,
        le=65536,
        description="Expert-parallel degree: experts are split over groups of ep ranks taken "
        "from dp x cp; it must divide the world size and the number of experts.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collectives: 'auto' is nccl when CUDA is available, else gloo."
    )
    timeout_s: float = Field(
        1800.0,
        ge=10,
        le=86400,
        description="A collective waiting longer than this fails the job (a rank died or hung). "
        "Followers wait in a collective while the leader pulls, so keep it above pull_wait_s.",
    )
    packing: PackingConfig = Field(
        default_factory=PackingConfig, description="Global sequence packing."
    )


class JobConfig(StrictModel):
    """A training job the service runs from start-up."""

    phase: Literal["cpt", "sft", "rl"] = Field(description="What to train.")
    model: ModelSettings = Field(default_factory=ModelSettings, description="Model.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="Router replay.")
    rl: RLConfig = Field(default_factory=RLConfig, description="RL step (phase = 'rl').")
    data: DataConfig | None = Field(None, description="Data (phase = 'cpt' or 'sft').")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints."
    )
    dist: DistConfig = Field(
        default_factory=DistConfig,
        description="Parallel layout under torchrun; in one process every degree must be 1.",
    )
    max_steps: int = Field(
        0, ge=0, description="Stop after this many steps; 0 runs until the data ends or SIGTERM."
    )
    publish_interval_steps: int = Field(
        1, ge=0, description="Publish a policy version every this many steps; 0 never."
    )
    export_dir: Path | None = Field(
        None, description="When the job ends, write the model here as an HF model directory."
    )
    metrics_file: Path | None = Field(
        None, description="Append each step's metrics here as one JSON line."
    )
    seed: int = Field(0, ge=0, description="Seed of the torch and Python RNGs.")
    num_threads: int = Field(0, ge=0, le=1024, description="torch threads; 0 keeps torch's choice.")
    prefix_sharing: Literal["auto", "off"] = Field(
        "auto",
        description="'auto': sequences of a microbatch that begin alike (the system prompt, a "
        "group's task) are packed as a prefix tree and their shared tokens computed once, "
        "wherever each sequence is whole on one rank (dist.cp = 1) and no MTP head needs "
        "the tokens after a shared one (model.num_mtp_heads = 0); the gradients are those "
        "of packing each sequence alone. 'off': every sequence packed whole.",
    )

    @property
    def shares_prefixes(self) -> bool:
        """Whether this job packs prefix trees (``prefix_sharing`` where the layout allows)."""
        return self.prefix_sharing == "auto" and self.dist.cp == 1 and self.model.num_mtp_heads == 0

    @model_validator(mode="after")
    def _data_for_phase(self) -> JobConfig:
        if self.dist.timeout_s <= self.rl.pull_wait_s:
            raise ValueError(
                f"dist.timeout_s ({self.dist.timeout_s}) must exceed rl.pull_wait_s "
                f"({self.rl.pull_wait_s}): the other ranks wait that long for each pull"
            )
        if self.phase in ("cpt", "sft") and self.data is None:
            raise ValueError(f"phase = {self.phase!r} needs [trainer.job.data] (got data = None)")
        if self.phase == "sft" and self.data is not None and self.data.kind != "jsonl":
            raise ValueError(
                f"phase = 'sft' trains on (prompt, completion) pairs: data.kind must be 'jsonl', "
                f"got {self.data.kind!r}"
            )
        return self


class TrainerConfig(ServiceConfig):
    """The MoE policy trainer; ready when the reconciler and the object store are."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50054), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9104), description="HTTP listener."
    )
    checkpoint_dir: Path | None = Field(
        None, description="Where checkpoints live; unset is <run.state_dir>/checkpoints/<run.name>."
    )
    job: JobConfig | None = Field(
        None, description="The training job; unset, the trainer only answers status."
    )


class TrainerProcessConfig(SharedConfig):
    """What the trainer's process reads: the shared sections and ``[trainer]``."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Trainer service.")
