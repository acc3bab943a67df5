"""Qwen3-MoE as a PyTorch module over a packed token stream, with router replay.

Module names mirror the HF checkpoint (``model.layers.0.self_attn.q_proj``,
``model.layers.0.mlp.gate``, ...), so the state dict maps onto the safetensors layout
one to one except for the experts, which are one ``MoEExperts`` module per layer
(fused ``gate_up [E, 2F, D]`` and ``down [E, D, F]``: a grouped GEMM, and the unit
expert parallelism shards). ``services.trainer.model.hf_io`` does the mapping.

``numerics = "fused"`` rounds where vLLM's CPU kernels do: the residual add and the norm
after it are one float32 operation (the norm sees the unrounded sum; the residual stream
keeps its bf16 rounding), RoPE rounds once, SwiGLU runs in float32 on the GEMM's float32
sums, and the top-k expert outputs are weighted (by bf16-rounded gates) and summed in
float32 before one rounding. Between layers the stream is then the float32 sum of the
residual and the MoE output, which the next layer rounds into its residual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.dtypes import resolve_dtype
from services.trainer.model.architecture import Architecture
from services.trainer.model.layers import Attention, Numerics, RMSNorm, linear, rope_tables
from services.trainer.model.mtp import MTPHead, mtp_distillation_loss
from services.trainer.model.prefix_tree import build_prefix_tree
from services.trainer.model.routing import Router, RoutingDecision
from services.trainer.precision import MoEExperts, PrecisionConfig
from services.trainer.precision.rounding import kernel_round

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_compute_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The activation dtype a setting names (``auto``: ``services.dtypes.resolve_dtype``)."""
    return DTYPES[resolve_dtype(name, torch.device(device).type)]


def resolve_experts_precision(
    name: str, dtype: torch.dtype, backend: str = "auto"
) -> PrecisionConfig:
    """The expert GEMMs' recipe a setting names; ``auto`` follows the compute ``dtype``."""
    if name == "auto":
        name = "fp32" if dtype == torch.float32 else "bf16"
    return PrecisionConfig(precision=name, backend=backend)


@dataclass
class PackedInputs:
    """A flat token stream of several sequences, and the routing to replay on it."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at 0 in each sequence
    cu_seqlens: list[int]  # [S + 1] sequence boundaries (runs of a prefix tree)
    replay_experts: torch.Tensor | None = None  # [T, layers, k] int64
    replay_mask: torch.Tensor | None = None  # [T] bool: tokens that have replay data
    # A prefix-shared stream (``pack_shared``): per run, the runs above it; None when the
    # sequences are independent.
    ancestors: list[list[int]] | None = None

    @property
    def shares_prefixes(self) -> bool:
        """True when some run attends to runs above it (a prefix tree, not flat sequences)."""
        return self.ancestors is not None and any(self.ancestors)

    @classmethod
    def pack(
        cls,
        sequences: Sequence[Sequence[int]],
        replay: Sequence[torch.Tensor | None] | None = None,
        *,
        num_layers: int = 0,
        top_k: int = 0,
    ) -> PackedInputs:
        """Packs token lists; ``replay[i]`` is ``[len(sequences[i]), layers, k]`` or None.

        Tokens whose replay rows are -1 (no routing recorded) route by the router.
        """
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("pack needs at least one sequence and no empty sequence")
        lengths = [len(s) for s in sequences]
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        position_ids = torch.cat([torch.arange(n) for n in lengths])
        if replay is None or all(r is None for r in replay):
            return cls(input_ids, position_ids, cu)
        if len(replay) != len(sequences):
            raise ValueError(f"{len(replay)} replay entries for {len(sequences)} sequences")
        blocks, masks = [], []
        for length, routes in zip(lengths, replay, strict=True):
            if routes is None:
                blocks.append(torch.zeros(length, num_layers, top_k, dtype=torch.long))
                masks.append(torch.zeros(length, dtype=torch.bool))
            else:
                if tuple(routes.shape) != (length, num_layers, top_k):
                    raise ValueError(
                        f"replay of shape {tuple(routes.shape)} for a sequence of {length} "
                        f"tokens; expected ({length}, {num_layers}, {top_k})"
                    )
                recorded = (routes >= 0).flatten(1).all(dim=1)
                blocks.append(routes.long().clamp_min(0))
                masks.append(recorded)
        return cls(input_ids, position_ids, cu, torch.cat(blocks), torch.cat(masks))

    @classmethod
    def pack_shared(
        cls,
        sequences: Sequence[Sequence[int]],
        trained: Sequence[Sequence[bool]],
        replay: Sequence[torch.Tensor | None] | None = None,
        *,
        num_layers: int = 0,
        top_k: int = 0,
    ) -> tuple[PackedInputs, torch.Tensor]:
        """Packs token lists as a prefix tree (``services.trainer.model.prefix_tree``).

        Returns the inputs and, per stream token, its index into the concatenated
        sequences: gather any per-token data (targets, masks...) with it.
        """
        flat = cls.pack(sequences, replay, num_layers=num_layers, top_k=top_k)
        tree = build_prefix_tree(sequences, trained, replay)
        source = tree.source

        def gather(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[source]

        inputs = cls(
            flat.input_ids[source],
            tree.position_ids,
            tree.cu_runs,
            gather(flat.replay_experts),
            gather(flat.replay_mask),
            tree.ancestors,
        )
        return inputs, source


@dataclass
class ForwardOutput:
    """Final hidden states and what the routers did."""

    hidden: torch.Tensor  # [T, hidden], after the final norm
    experts: torch.Tensor  # [T, layers, k]: the experts each token was sent to
    num_replaced: list[int]  # per layer: replayed choices the plausibility filter replaced
    num_replayed: int  # tokens routed by replay (per layer)


class MoEBlock(nn.Module):
    """Router (``gate``) and experts; tokens sorted by expert through one grouped GEMM."""

    def __init__(
        self, arch: Architecture, precision: PrecisionConfig, numerics: Numerics = "eager"
    ) -> None:
        super().__init__()
        self.numerics = numerics
        self.gate = Router(
            arch.hidden_size, arch.num_experts, arch.top_k, normalize=arch.norm_topk_prob
        )
        self.experts = MoEExperts(
            arch.num_experts, arch.hidden_size, arch.moe_intermediate_size, precision
        )

    def forward(
        self,
        x: torch.Tensor,
        replay: torch.Tensor | None,
        replay_mask: torch.Tensor | None,
        min_prob_ratio: float,
    ) -> tuple[torch.Tensor, RoutingDecision]:
        """``x [T, hidden]`` -> (``[T, hidden]``, the routing used)."""
        decision = self.gate(x, replay, replay_mask, min_prob_ratio)
        top_k = decision.experts.shape[1]
        flat = decision.experts.flatten()
        # A stable sort keeps each expert's tokens in stream order, and the index_add below
        # then accumulates expert outputs in ascending expert order, as transformers does.
        order = torch.argsort(flat, stable=True)
        source = order // top_k
        group_sizes = torch.bincount(flat, minlength=self.experts.num_experts)
        gates = decision.weights.flatten()[order]
        if self.numerics == "fused":
            # float32 expert outputs, weighted by the gates as the router rounds them
            # (its softmax runs in the compute dtype), summed in float32, rounded once.
            out = self.experts(x[source], group_sizes, fused=True)
            weighted = out * gates.to(x.dtype).float().unsqueeze(-1)
            combined = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            return kernel_round(combined.index_add(0, source, weighted), x.dtype), decision
        out = self.experts(x[source], group_sizes)
        weighted = out * gates.to(out.dtype).unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, source, weighted), decision


class DecoderLayer(nn.Module):
    """Pre-norm attention and MoE, each with a residual connection.

    With ``numerics = "fused"`` the stream in and out is float32 (the unrounded sum of the
    residual and the last branch); the compute dtype is that of the ``rope`` tables.
    """

    def __init__(
        self, arch: Architecture, precision: PrecisionConfig, numerics: Numerics = "eager"
    ) -> None:
        super().__init__()
        self.numerics = numerics
        self.self_attn = Attention(
            arch.hidden_size,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
            arch.rms_norm_eps,
            numerics,
        )
        self.mlp = MoEBlock(arch, precision, numerics)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: Sequence[int],
        replay: torch.Tensor | None,
        replay_mask: torch.Tensor | None,
        min_prob_ratio: float,
        ancestors: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, RoutingDecision]:
        """``hidden [T, D]`` -> (``[T, D]``, this layer's routing)."""
        if self.numerics == "fused":
            return self._forward_fused(
                hidden, rope, cu_seqlens, replay, replay_mask, min_prob_ratio, ancestors
            )
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, cu_seqlens, ancestors)
        moe_out, decision = self.mlp(
            self.post_attention_layernorm(hidden), replay, replay_mask, min_prob_ratio
        )
        return hidden + moe_out, decision

    def _forward_fused(
        self,
        stream: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: Sequence[int],
        replay: torch.Tensor | None,
        replay_mask: torch.Tensor | None,
        min_prob_ratio: float,
        ancestors: Sequence[Sequence[int]] | None,
    ) -> tuple[torch.Tensor, RoutingDecision]:
        dtype = rope[0].dtype
        residual = stream.to(dtype)
        attended = self.self_attn(self.input_layernorm(stream, dtype), rope, cu_seqlens, ancestors)
        stream = residual.float() + attended.float()
        residual = stream.to(dtype)
        moe_out, decision = self.mlp(
            self.post_attention_layernorm(stream, dtype), replay, replay_mask, min_prob_ratio
        )
        return residual.float() + moe_out.float(), decision


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm (``model.*`` in the HF layout)."""

    def __init__(
        self, arch: Architecture, precision: PrecisionConfig, numerics: Numerics = "eager"
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, precision, numerics) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Qwen3MoE(nn.Module):
    """The causal LM: ``model`` (backbone), an untied ``lm_head`` and optional ``mtp`` heads.

    ``dtype`` is the compute dtype of activations; parameters stay float32 (the
    optimizer's master copy) and are cast per use. ``replay_min_prob_ratio`` is the
    plausibility filter's fraction of the router's k-th largest probability.
    ``numerics`` picks the rounding order (``services.trainer.model.layers.Numerics``):
    transformers' (``"eager"``) or an inference engine's fused kernels (``"fused"``).
    """

    def __init__(
        self,
        arch: Architecture,
        *,
        dtype: torch.dtype = torch.bfloat16,
        experts_precision: PrecisionConfig | None = None,
        replay_min_prob_ratio: float = 0.1,
        num_mtp_heads: int = 0,
        numerics: Numerics = "eager",
    ) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.replay_min_prob_ratio = replay_min_prob_ratio
        self.numerics = numerics
        precision = experts_precision or resolve_experts_precision("auto", dtype)
        if numerics == "fused" and precision.precision not in ("bf16", "fp32"):
            raise ValueError(
                f"numerics 'fused' needs the bf16 or fp32 expert recipe, not "
                f"{precision.precision!r}"
            )
        self.model = Backbone(arch, precision, numerics)
        # Recompute each decoder layer in backward instead of keeping its activations: the
        # activation memory of one layer input per layer, for one more forward of compute.
        self.activation_checkpointing = False
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPHead(arch) for _ in range(num_mtp_heads))

    def compile_layers(self) -> None:
        """``torch.compile`` each decoder layer in place (Inductor; the weights stay where
        they are). The layer's Python loop over sequences is traced with the sequence
        lengths as constants, so a microbatch of new lengths compiles again."""
        for layer in self.model.layers:
            layer.compile()

    def forward(self, inputs: PackedInputs) -> ForwardOutput:
        """Runs the stream; routes by replay where ``inputs`` carries it."""
        arch = self.arch
        if inputs.replay_experts is not None and tuple(inputs.replay_experts.shape[1:]) != (
            arch.num_layers,
            arch.top_k,
        ):
            raise ValueError(
                f"replay_experts must be [T, {arch.num_layers}, {arch.top_k}], got "
                f"{tuple(inputs.replay_experts.shape)}"
            )
        hidden = F.embedding(inputs.input_ids, self.model.embed_tokens.weight).to(self.dtype)
        rope = rope_tables(inputs.position_ids, arch.head_dim, arch.rope_theta, self.dtype)
        chosen, replaced = [], []
        num_replayed = 0
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for index, layer in enumerate(self.model.layers):
            replay = None if inputs.replay_experts is None else inputs.replay_experts[:, index]
            args = (
                hidden,
                rope,
                inputs.cu_seqlens,
                replay,
                inputs.replay_mask,
                self.replay_min_prob_ratio,
                inputs.ancestors,
            )
            if recompute:
                # Keeps only the block's input; backward runs the block again. The
                # recomputation routes exactly as the first pass (same inputs, same bits).
                hidden, decision = checkpoint(layer, *args, use_reentrant=False)
            else:
                hidden, decision = layer(*args)
            chosen.append(decision.experts)
            replaced.append(decision.num_replaced)
            num_replayed = decision.num_replayed
        return ForwardOutput(
            self.model.norm(hidden, self.dtype), torch.stack(chosen, dim=1), replaced, num_replayed
        )

    def mtp_loss(
        self, inputs: PackedInputs, output: ForwardOutput
    ) -> tuple[torch.Tensor, list[float]]:
        """Self-distillation loss of the MTP heads on this stream (see ``model.mtp``)."""
        if not len(self.mtp):
            raise ValueError("the model has no MTP heads (num_mtp_heads = 0)")
        if inputs.shares_prefixes:
            # A head at a shared token would need the next tokens of every branch below it.
            raise ValueError(
                "MTP heads need independently packed sequences, not a prefix-shared stream "
                "(trainer.job.prefix_sharing = 'auto' packs them so when num_mtp_heads > 0)"
            )
        rope = rope_tables(
            inputs.position_ids, self.arch.head_dim, self.arch.rope_theta, self.dtype
        )
        with torch.no_grad():
            main_logits = self.logits(output.hidden)
        return mtp_distillation_loss(
            [head for head in self.mtp if isinstance(head, MTPHead)],
            output.hidden,
            main_logits,
            inputs.input_ids,
            self.model.embed_tokens.weight.detach(),
            self.lm_head.weight.detach(),
            rope,
            inputs.cu_seqlens,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, D]`` -> float32 logits ``[N, V]`` (the head runs in the compute dtype)."""
        return linear(hidden, self.lm_head.weight).float()


def token_logprobs(
    model: Qwen3MoE, hidden: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets [N]`` under the head at ``hidden [N, D]``; entropy too.

    Only the rows a loss needs are passed in, so the ``[N, V]`` logits stay as small as
    the number of trained tokens.
    """
    log_probs = torch.log_softmax(model.logits(hidden), dim=-1)
    picked = log_probs.gather(1, targets[:, None])[:, 0]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return picked, entropy
