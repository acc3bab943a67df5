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
from typing import TYPE_CHECKING, Literal

import torch

from services.trainer.batch import Microbatch, RLBatch
from services.trainer.config import JobConfig
from services.trainer.loss import next_token_loss, policy_loss
from services.trainer.model import (
    ForwardOutput,
    Qwen3MoE,
    load_pretrained,
    resolve_compute_dtype,
    resolve_experts_precision,
    token_logprobs,
)
from services.trainer.optim import build_optimizers, clip_and_step, set_learning_rate

if TYPE_CHECKING:
    from services.trainer.distributed.runtime import Runtime


class Learner:
    """Owns the trainable state of a job."""

    def __init__(
        self,
        model: Qwen3MoE,
        job: JobConfig,
        reference: Qwen3MoE | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        if runtime is not None and job.optimizer.name == "muon":
            raise ValueError(
                "optimizer.name = 'muon' orthogonalizes whole matrices, which FSDP2 shards "
                "over the ranks; use 'adamw' when the trainer is distributed"
            )
        self.model = model
        self.job = job
        self.reference = reference
        self.runtime = runtime
        self.optimizers = build_optimizers(model, job.optimizer)

    @classmethod
    def load(cls, model_dir: Path, job: JobConfig, runtime: Runtime | None = None) -> Learner:
        """The job's model from ``model_dir``, and a reference copy when the KL needs one.

        With a ``runtime`` both are sharded for this rank (``distributed.parallelize``).
        """
        settings = job.model
        dtype = resolve_compute_dtype(
            settings.compute_dtype, runtime.device if runtime is not None else "cpu"
        )
        model = load_pretrained(
            model_dir,
            dtype=dtype,
            experts_precision=resolve_experts_precision(
                settings.experts_precision, dtype, settings.experts_backend
            ),
            replay_min_prob_ratio=job.replay.min_prob_ratio,
            num_mtp_heads=settings.num_mtp_heads,
            seed=job.seed,
            numerics=settings.numerics,
        )
        reference = None
        if job.phase == "rl" and job.rl.kl_coef > 0:
            reference = copy.deepcopy(model).requires_grad_(False)
        if runtime is not None:
            from services.trainer.distributed.parallelize import parallelize

            for module in (model, reference):
                if module is not None:
                    parallelize(module, runtime.meshes, runtime.device)
        return cls(model, job, reference, runtime)

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
        # The mean over the microbatches of every replica (each replica's gradients add up).
        replicas = 1 if self.runtime is None else self.runtime.layout.dp
        return self.job.model.mtp_loss_coef * loss / (num_microbatches * replicas), per_head

    def _reduce(self, values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
        """``values`` over every rank (as they are in one process)."""
        return values if self.runtime is None else self.runtime.all_reduce(values, op)

    def _step(self) -> float:
        max_norm = self.job.optimizer.max_grad_norm
        if self.runtime is None:
            return clip_and_step(self.model, self.optimizers, max_norm)
        return self.runtime.clip_and_step(self.model, self.optimizers, max_norm)

    def _on_device(self, microbatch: Microbatch) -> Microbatch:
        return microbatch if self.runtime is None else microbatch.to(self.runtime.device)

    def rl_step(self, batch: RLBatch, step: int) -> dict[str, float]:
        """One optimizer step on ``batch``; ``step`` (0-based) sets the warm-up.

        Distributed, ``batch`` holds this rank's microbatches and the step's global
        statistics (``num_rollouts`` sets the normalizer, the same on every rank); the
        metrics are those of the whole step.
        """
        rl = self.job.rl
        lr = set_learning_rate(self.optimizers, self.job.optimizer, step)
        normalizer = max(batch.num_rollouts, 1) * rl.generation_budget_tokens
        layers = self.model.arch.num_layers
        pg = kl = mtp_total = 0.0
        sums = dict.fromkeys(("ratio", "clipped", "k1", "entropy", "mismatch"), 0.0)
        ratio_max = 0.0
        replaced = [0] * layers
        replayed = tokens = computed = trained = 0
        self.model.train()
        for local in batch.microbatches:
            microbatch = self._on_device(local)
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
            mismatch = (logprobs.detach() - microbatch.behaviour_logprobs[rows]).abs()
            for name, values in (
                ("ratio", terms.importance_ratio),
                ("clipped", terms.clipped),
                ("k1", terms.k1),
                ("entropy", entropy),
                ("mismatch", mismatch),
            ):
                sums[name] += float(values.double().sum())
            if rows.numel():
                ratio_max = max(ratio_max, float(terms.importance_ratio.max()))
            replaced = [a + b for a, b in zip(replaced, output.num_replaced, strict=True)]
            replayed += output.num_replayed
            tokens += microbatch.num_data_tokens
            computed += microbatch.num_tokens
            trained += int(rows.numel())
        if batch.num_rollouts:
            grad_norm = self._step()
        else:
            # Every group of the step was skipped (the same on every rank: num_rollouts is
            # the step's): no optimizer step, or Adam's momentum would move the weights.
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            grad_norm = 0.0
        names = list(sums)
        totals = self._reduce(
            [pg, kl, mtp_total, *sums.values(), replayed, tokens, computed, trained, *replaced]
        )
        pg, kl, mtp_total = totals[:3]
        sums = dict(zip(names, totals[3:8], strict=True))
        replayed, tokens, computed, trained = (int(value) for value in totals[8:12])
        replaced = [int(value) for value in totals[12:]]
        ratio_max = self._reduce([ratio_max], "max")[0]
        choices = max(replayed * self.model.arch.top_k, 1)

        def mean(name: str) -> float:
            return sums[name] / trained if trained else 0.0

        metrics = {
            "loss": pg + kl + mtp_total,
            "loss_pg": pg,
            "loss_kl": kl,
            "loss_mtp": mtp_total,
            "kl": mean("k1"),
            "is_ratio_mean": mean("ratio"),
            "is_ratio_max": ratio_max,
            "is_clipped_fraction": mean("clipped"),
            "entropy": mean("entropy"),
            "logprob_mismatch": mean("mismatch"),
            "replay_replacement_rate": sum(replaced) / (choices * layers),
            "replay_token_fraction": replayed / max(computed, 1),
            "tokens": float(tokens),
            "tokens_computed": float(computed),
            "tokens_trained": float(trained),
            "grad_norm": grad_norm,
            "lr": lr,
        }
        for layer, count in enumerate(replaced):
            metrics[f"replay_replacement_rate_layer{layer}"] = count / choices
        return metrics

    def sft_step(self, microbatches: Sequence[Microbatch], step: int) -> dict[str, float]:
        """One optimizer step of next-token loss on the trained tokens of ``microbatches``.

        Distributed, ``microbatches`` are this rank's; the loss is over the whole step's
        trained tokens.
        """
        lr = set_learning_rate(self.optimizers, self.job.optimizer, step)
        num_trained = int(self._reduce([sum(int(mb.trained.sum()) for mb in microbatches)])[0])
        if num_trained == 0:
            raise ValueError("an SFT step needs at least one trained token")
        nll = mtp_total = 0.0
        tokens = computed = 0
        self.model.train()
        for local in microbatches:
            microbatch = self._on_device(local)
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
            tokens += microbatch.num_data_tokens
            computed += microbatch.num_tokens
        grad_norm = self._step()
        nll, mtp_total, total_tokens, total_computed = self._reduce(
            [nll, mtp_total, tokens, computed]
        )
        return {
            "loss": nll,
            "loss_mtp": mtp_total,
            "tokens": total_tokens,
            "tokens_computed": total_computed,
            "tokens_trained": float(num_trained),
            "grad_norm": grad_norm,
            "lr": lr,
        }
