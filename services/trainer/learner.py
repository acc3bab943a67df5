"""The learner: the policy, its frozen reference, its optimizers, and one training step.

``rl_step`` runs each microbatch forward with router replay, takes the policy loss
(``services.trainer.loss``) on the generated tokens, accumulates gradients, then clips
and steps once; ``sft_step`` does the same with the next-token loss. Both return the
step's metrics. Nothing here talks to other services.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

from services.trainer.batch import Microbatch, RLBatch
from services.trainer.config import JobConfig
from services.trainer.loss import next_token_loss, policy_loss
from services.trainer.model import (
    DTYPES,
    ForwardOutput,
    Qwen3MoE,
    load_pretrained,
    token_logprobs,
)
from services.trainer.optim import build_optimizers, clip_and_step, set_learning_rate
from services.trainer.precision import PrecisionConfig


def _mean(values: torch.Tensor) -> float:
    return float(values.double().mean()) if values.numel() else 0.0


class Learner:
    """Owns the trainable state of a job."""

    def __init__(
        self,
        model: Qwen3MoE,
        job: JobConfig,
        reference: Qwen3MoE | None = None,
    ) -> None:
        self.model = model
        self.job = job
        self.reference = reference
        self.optimizers = build_optimizers(model, job.optimizer)

    @classmethod
    def load(cls, model_dir: Path, job: JobConfig) -> Learner:
        """The job's model from ``model_dir``, and a reference copy when the KL needs one."""
        settings = job.model
        model = load_pretrained(
            model_dir,
            dtype=DTYPES[settings.compute_dtype],
            experts_precision=PrecisionConfig(
                precision=settings.experts_precision, backend=settings.experts_backend
            ),
            replay_min_prob_ratio=job.replay.min_prob_ratio,
            num_mtp_heads=settings.num_mtp_heads,
            seed=job.seed,
        )
        reference = None
        if job.phase == "rl" and job.rl.kl_coef > 0:
            reference = copy.deepcopy(model).requires_grad_(False)
        return cls(model, job, reference)

    def refresh_reference(self) -> None:
        """The reference becomes a copy of the current policy."""
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    def _mtp(
        self, microbatch: Microbatch, output: ForwardOutput, num_microbatches: int
    ) -> tuple[torch.Tensor | None, list[float]]:
        """The weighted MTP distillation loss of one microbatch (None without MTP heads)."""
        if not len(self.model.mtp) or self.job.model.mtp_loss_coef == 0:
            return None, []
        loss, per_head = self.model.mtp_loss(microbatch.inputs, output)
        return self.job.model.mtp_loss_coef * loss / num_microbatches, per_head

    def rl_step(self, batch: RLBatch, step: int) -> dict[str, float]:
        """One optimizer step on ``batch``; ``step`` (0-based) sets the warm-up."""
        rl = self.job.rl
        lr = set_learning_rate(self.optimizers, self.job.optimizer, step)
        normalizer = max(batch.num_rollouts, 1) * rl.generation_budget_tokens
        layers = self.model.arch.num_layers
        pg = kl = mtp_total = 0.0
        stats: dict[str, list[torch.Tensor]] = {
            name: [] for name in ("ratio", "clipped", "k1", "entropy", "mismatch")
        }
        replaced = [0] * layers
        replayed = tokens = 0
        self.model.train()
        for microbatch in batch.microbatches:
            output = self.model(microbatch.inputs)
            rows = microbatch.trained.nonzero()[:, 0]
            targets = microbatch.targets[rows]
            logprobs, entropy = token_logprobs(
                self.model, output.hidden[rows], targets, with_entropy=True
            )
            reference_logprobs = None
            if self.reference is not None and rl.kl_coef > 0:
                with torch.no_grad():
                    reference_out = self.reference(microbatch.inputs)
                    reference_logprobs, _ = token_logprobs(
                        self.reference, reference_out.hidden[rows], targets
                    )
            terms = policy_loss(
                logprobs,
                microbatch.behaviour_logprobs[rows],
                microbatch.advantages[rows],
                microbatch.weights[rows],
                normalizer=normalizer,
                importance_cap=rl.importance_cap,
                kl_coef=rl.kl_coef,
                reference_logprobs=reference_logprobs,
            )
            loss = terms.loss
            mtp_loss, _ = self._mtp(microbatch, output, len(batch.microbatches))
            if mtp_loss is not None:
                loss = loss + mtp_loss
                mtp_total += float(mtp_loss.detach())
            loss.backward()
            pg += float(terms.policy_gradient)
            kl += float(terms.kl_penalty)
            assert entropy is not None
            stats["ratio"].append(terms.importance_ratio)
            stats["clipped"].append(terms.clipped.float())
            stats["k1"].append(terms.k1)
            stats["entropy"].append(entropy)
            stats["mismatch"].append(
                (logprobs.detach() - microbatch.behaviour_logprobs[rows]).abs()
            )
            replaced = [a + b for a, b in zip(replaced, output.num_replaced, strict=True)]
            replayed += output.num_replayed
            tokens += microbatch.num_tokens
        grad_norm = clip_and_step(self.model, self.optimizers, self.job.optimizer.max_grad_norm)
        choices = max(replayed * self.model.arch.top_k, 1)
        flat = {
            name: torch.cat(values) if values else torch.zeros(0) for name, values in stats.items()
        }
        metrics = {
            "loss": pg + kl + mtp_total,
            "loss_pg": pg,
            "loss_kl": kl,
            "loss_mtp": mtp_total,
            "kl": _mean(flat["k1"]),
            "is_ratio_mean": _mean(flat["ratio"]),
            "is_ratio_max": float(flat["ratio"].max()) if flat["ratio"].numel() else 0.0,
            "is_clipped_fraction": _mean(flat["clipped"]),
            "entropy": _mean(flat["entropy"]),
            "logprob_mismatch": _mean(flat["mismatch"]),
            "replay_replacement_rate": sum(replaced) / (choices * layers),
            "replay_token_fraction": replayed / max(tokens, 1),
            "tokens": float(tokens),
            "tokens_trained": float(flat["k1"].numel()),
            "grad_norm": grad_norm,
            "lr": lr,
        }
        for layer, count in enumerate(replaced):
            metrics[f"replay_replacement_rate_layer{layer}"] = count / choices
        return metrics

    def sft_step(self, microbatches: Sequence[Microbatch], step: int) -> dict[str, float]:
        """One optimizer step of next-token loss on the trained tokens of ``microbatches``."""
        lr = set_learning_rate(self.optimizers, self.job.optimizer, step)
        num_trained = sum(int(mb.trained.sum()) for mb in microbatches)
        if num_trained == 0:
            raise ValueError("an SFT step needs at least one trained token")
        nll = mtp_total = 0.0
        tokens = 0
        self.model.train()
        for microbatch in microbatches:
            output = self.model(microbatch.inputs)
            rows = microbatch.trained.nonzero()[:, 0]
            logprobs, _ = token_logprobs(self.model, output.hidden[rows], microbatch.targets[rows])
            loss = next_token_loss(logprobs, num_trained)
            nll += float(loss.detach())
            mtp_loss, _ = self._mtp(microbatch, output, len(microbatches))
            if mtp_loss is not None:
                loss = loss + mtp_loss
                mtp_total += float(mtp_loss.detach())
            loss.backward()
            tokens += microbatch.num_tokens
        grad_norm = clip_and_step(self.model, self.optimizers, self.job.optimizer.max_grad_norm)
        return {
            "loss": nll,
            "loss_mtp": mtp_total,
            "tokens": float(tokens),
            "tokens_trained": float(num_trained),
            "grad_norm": grad_norm,
            "lr": lr,
        }
