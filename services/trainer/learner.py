"""The learner: the policy, its frozen reference, its optimizers, and one training step.

``rl_step`` runs each microbatch forward with router replay, takes the policy loss
(``services.trainer.loss``) on the generated tokens, accumulates gradients, then clips
and steps once; ``sft_step`` does the same with the next-token loss. Both return the
step's metrics, summed by name over microbatches and (through the runtime) over ranks.
Nothing here talks to other services.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from services.config.trainer import JobConfig
from services.trainer.batch import Microbatch, RLBatch
from services.trainer.loss import next_token_loss, policy_loss
from services.trainer.model import (
    ForwardOutput,
    Qwen3MoE,
    resolve_compute_dtype,
    resolve_experts_precision,
    token_logprobs,
)
from services.trainer.offpolicy import LAG_SUM_NAMES, lag_metrics, lag_sums, max_lag
from services.trainer.optim import build_optimizers, set_learning_rate
from services.trainer.runtime import LocalRuntime, TrainerRuntime


class StepSums:
    """A step's quantities, summed by name over microbatches, then over every rank."""

    def __init__(self, names: Sequence[str]) -> None:
        self.values = dict.fromkeys(names, 0.0)  # one order on every rank

    def add(self, **values: float) -> None:
        """Adds each named value to its sum."""
        for name, value in values.items():
            self.values[name] += value

    def reduced(
        self, runtime: TrainerRuntime, op: Literal["sum", "max"] = "sum"
    ) -> dict[str, float]:
        """Every sum over every rank (``op = "max"``: the largest value instead)."""
        names = list(self.values)
        totals = runtime.all_reduce([self.values[name] for name in names], op)
        return dict(zip(names, totals, strict=True))


class Learner:
    """Owns the trainable state of a job."""

    def __init__(
        self,
        model: Qwen3MoE,
        job: JobConfig,
        reference: Qwen3MoE | None = None,
        runtime: TrainerRuntime | None = None,
    ) -> None:
        self.runtime = runtime or LocalRuntime()
        self.model = model
        self.job = job
        self.reference = reference
        self.optimizers = build_optimizers(model, job.optimizer)

    @classmethod
    def load(
        cls, model_dir: Path, job: JobConfig, runtime: TrainerRuntime | None = None
    ) -> Learner:
        """The job's model from ``model_dir``, and a reference copy when the KL needs one,
        each laid out for this rank by ``runtime`` (whole in one process)."""
        runtime = runtime or LocalRuntime()
        settings = job.model
        dtype = resolve_compute_dtype(settings.compute_dtype, runtime.device)
        options: dict[str, Any] = {
            "dtype": dtype,
            "experts_precision": resolve_experts_precision(
                settings.experts_precision, dtype, settings.experts_backend
            ),
            "replay_min_prob_ratio": job.replay.min_prob_ratio,
            "num_mtp_heads": settings.num_mtp_heads,
            "numerics": settings.numerics,
        }
        model = runtime.load_model(model_dir, seed=job.seed, **options)
        model.activation_checkpointing = settings.activation_checkpointing
        reference = None
        if job.phase == "rl" and job.rl.kl_coef > 0:
            # Loaded as the policy is (this rank's shards only), frozen: no gradients, so
            # no optimizer state and no recomputation.
            reference = runtime.load_model(model_dir, seed=job.seed, **options)
            reference.requires_grad_(False)
        for each in (model, reference):
            if each is not None and settings.compile:
                each.compile_layers()
        return cls(model, job, reference, runtime)

    def refresh_reference(self) -> None:
        """The reference becomes a copy of the current policy."""
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    def _mtp(
        self, microbatch: Microbatch, output: ForwardOutput, num_microbatches: int
    ) -> torch.Tensor | None:
        """The weighted MTP distillation loss of one microbatch (None without MTP heads)."""
        if not len(self.model.mtp) or self.job.model.mtp_loss_coef == 0:
            return None
        loss, _ = self.model.mtp_loss(microbatch.inputs, output)
        # The mean over the microbatches of every replica (each replica's gradients add up).
        replicas = self.runtime.layout.dp
        return self.job.model.mtp_loss_coef * loss / (num_microbatches * replicas)

    def _step(self) -> float:
        max_norm = self.job.optimizer.max_grad_norm
        return self.runtime.clip_and_step(self.model, self.optimizers, max_norm)

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
        per_layer = [f"replaced_layer{layer}" for layer in range(layers)]
        sums = StepSums(
            (
                *("loss_pg", "loss_kl", "loss_mtp"),
                *("ratio", "clipped", "k1", "entropy", "mismatch"),
                *("replayed", "tokens", "computed", "trained", *per_layer),
                *LAG_SUM_NAMES,
            )
        )
        largest = StepSums(("ratio_max", "lag_max"))
        self.model.train()
        for local in batch.microbatches:
            microbatch = local.to(self.runtime.device)
            output = self.model(microbatch.inputs)
            rows = microbatch.trained.nonzero()[:, 0]
            targets = microbatch.targets[rows]
            logprobs, entropy = token_logprobs(
                self.model, output.hidden[rows], targets, with_entropy=True
            )
            assert entropy is not None
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
            mtp_loss = self._mtp(microbatch, output, len(batch.microbatches))
            if mtp_loss is not None:
                loss = loss + mtp_loss
                sums.add(loss_mtp=float(mtp_loss.detach()))
            loss.backward()
            mismatch = (logprobs.detach() - microbatch.behaviour_logprobs[rows]).abs()
            versions = microbatch.generating_versions[rows]
            sums.add(**lag_sums(versions, terms.importance_ratio, batch.policy_version))
            sums.add(
                loss_pg=float(terms.policy_gradient),
                loss_kl=float(terms.kl_penalty),
                ratio=float(terms.importance_ratio.double().sum()),
                clipped=float(terms.clipped.double().sum()),
                k1=float(terms.k1.double().sum()),
                entropy=float(entropy.double().sum()),
                mismatch=float(mismatch.double().sum()),
                replayed=output.num_replayed,
                tokens=microbatch.num_data_tokens,
                computed=microbatch.num_tokens,
                trained=int(rows.numel()),
                **dict(zip(per_layer, output.num_replaced, strict=True)),
            )
            if rows.numel():
                ratio_max = float(terms.importance_ratio.max())
                largest.values["ratio_max"] = max(largest.values["ratio_max"], ratio_max)
                lag = max_lag(versions, batch.policy_version)
                largest.values["lag_max"] = max(largest.values["lag_max"], lag)
        if batch.num_rollouts:
            grad_norm = self._step()
        else:
            # Every group of the step was skipped (the same on every rank: num_rollouts is
            # the step's): no optimizer step, or Adam's momentum would move the weights.
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            grad_norm = 0.0
        total = sums.reduced(self.runtime)
        maxima = largest.reduced(self.runtime, "max")
        replaced = [total[name] for name in per_layer]
        choices = max(total["replayed"] * self.model.arch.top_k, 1)
        trained = total["trained"]

        def mean(name: str) -> float:
            return total[name] / trained if trained else 0.0

        metrics = {
            "loss": total["loss_pg"] + total["loss_kl"] + total["loss_mtp"],
            "loss_pg": total["loss_pg"],
            "loss_kl": total["loss_kl"],
            "loss_mtp": total["loss_mtp"],
            "kl": mean("k1"),
            "is_ratio_mean": mean("ratio"),
            "is_ratio_max": maxima["ratio_max"],
            "is_clipped_fraction": mean("clipped"),
            "entropy": mean("entropy"),
            "logprob_mismatch": mean("mismatch"),
            "replay_replacement_rate": sum(replaced) / (choices * layers),
            "replay_token_fraction": total["replayed"] / max(total["computed"], 1),
            "tokens": total["tokens"],
            "tokens_computed": total["computed"],
            "tokens_trained": trained,
            "grad_norm": grad_norm,
            "lr": lr,
        }
        for layer, count in enumerate(replaced):
            metrics[f"replay_replacement_rate_layer{layer}"] = count / choices
        return metrics | lag_metrics(total, maxima["lag_max"])

    def sft_step(self, microbatches: Sequence[Microbatch], step: int) -> dict[str, float]:
        """One optimizer step of next-token loss on the trained tokens of ``microbatches``.

        Distributed, ``microbatches`` are this rank's; the loss is over the whole step's
        trained tokens.
        """
        lr = set_learning_rate(self.optimizers, self.job.optimizer, step)
        local_trained = StepSums(("trained",))
        local_trained.add(trained=sum(int(mb.trained.sum()) for mb in microbatches))
        num_trained = int(local_trained.reduced(self.runtime)["trained"])
        if num_trained == 0:
            raise ValueError("an SFT step needs at least one trained token")
        sums = StepSums(("loss", "loss_mtp", "tokens", "tokens_computed"))
        self.model.train()
        for local in microbatches:
            microbatch = local.to(self.runtime.device)
            output = self.model(microbatch.inputs)
            rows = microbatch.trained.nonzero()[:, 0]
            logprobs, _ = token_logprobs(self.model, output.hidden[rows], microbatch.targets[rows])
            loss = next_token_loss(logprobs, num_trained)
            sums.add(loss=float(loss.detach()))
            mtp_loss = self._mtp(microbatch, output, len(microbatches))
            if mtp_loss is not None:
                loss = loss + mtp_loss
                sums.add(loss_mtp=float(mtp_loss.detach()))
            loss.backward()
            sums.add(tokens=microbatch.num_data_tokens, tokens_computed=microbatch.num_tokens)
        grad_norm = self._step()
        return sums.reduced(self.runtime) | {
            "tokens_trained": float(num_trained),
            "grad_norm": grad_norm,
            "lr": lr,
        }
