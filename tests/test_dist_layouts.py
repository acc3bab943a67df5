"""Each parallel layout against the single-process trainer, on the same batch.

Every test spawns gloo processes on 127.0.0.1; each process computes the single-process
reference itself (tiny model, float32) and its own distributed share, and checks:

* the step's loss (summed over ranks) and every parameter's gradient (gathered whole)
  equal the reference's within float32 tolerance;
* a ``Learner.rl_step`` gives the reference's metrics and updated weights;
* so do two steps with Muon (matrices and expert stacks gathered and orthogonalized
  whole, ``services.trainer.muon``).

The batch has sequences of many lengths (none a multiple of 2 x cp, so context
parallelism pads), replayed routes on most of them (some implausible, so the filter
acts), and more sequences than ranks. A failed assertion in any process fails the test
with that process's traceback.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from services.config.trainer import JobConfig
from services.trainer.batch import RLBatch, TrainItem, pack_microbatch
from services.trainer.distributed.batching import assign, local_microbatches
from services.trainer.distributed.layout import ParallelLayout
from services.trainer.distributed.packing import CostModel
from services.trainer.distributed.parallelize import parallelize
from services.trainer.distributed.runtime import ProcessInfo, Runtime, start
from services.trainer.learner import Learner
from services.trainer.loss import policy_loss
from services.trainer.model import Architecture, Qwen3MoE, token_logprobs
from services.trainer.optim import muon_parameter
from services.trainer.precision import PrecisionConfig
from services.trainer.rollouts import SegmentTokens
from services.wire.ports import free_port

ARCH = Architecture(
    vocab_size=96,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=32,
    max_position_embeddings=256,
)
LENGTHS = (37, 9, 64, 21, 50, 15, 30, 44, 7, 26)
NORMALIZER = 600.0
GRAD_ATOL, GRAD_RTOL = 2e-6, 2e-4


def decisive_model(seed: int = 0, precision: str = "fp32") -> Qwen3MoE:
    """A float32 model whose distributions are peaked (unit fan-in weights, sharp router)."""
    model = Qwen3MoE(
        ARCH, dtype=torch.float32, experts_precision=PrecisionConfig(precision=precision)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                scale = (3.0 if name.endswith("mlp.gate.weight") else 1.0) / math.sqrt(
                    param.shape[-1]
                )
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
            else:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def batch_items(seed: int = 1) -> list[TrainItem]:
    """Sequences with prompts (untrained), replayed routes on most, advantages, weights."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for index, length in enumerate(LENGTHS):
        tokens = torch.randint(0, ARCH.vocab_size, (length + 1,), generator=generator).tolist()
        prompt = max(1, length // 4)
        replay = None
        if index % 3 != 2:
            replay = torch.randint(
                0, ARCH.num_experts, (length, ARCH.num_layers, ARCH.top_k), generator=generator
            )
            replay[-1] = -1  # the last token's routing was never recorded
        segment = SegmentTokens(
            input_ids=tokens[:-1],
            targets=tokens[1:],
            trained=[position >= prompt for position in range(length)],
            behaviour_logprobs=(-3 - torch.rand(length, generator=generator)).tolist(),
            replay=replay,
        )
        items.append((segment, float(index % 4) - 1.5, 1.0 - 0.1 * (index % 2)))
    return items


def loss_of(model: Qwen3MoE, microbatch: object) -> torch.Tensor:
    """The step's policy loss over one microbatch (k1 off: no reference model)."""
    from services.trainer.batch import Microbatch

    assert isinstance(microbatch, Microbatch)
    output = model(microbatch.inputs)
    rows = microbatch.trained.nonzero()[:, 0]
    logprobs, _ = token_logprobs(model, output.hidden[rows], microbatch.targets[rows])
    return policy_loss(
        logprobs,
        microbatch.behaviour_logprobs[rows],
        microbatch.advantages[rows],
        microbatch.weights[rows],
        normalizer=NORMALIZER,
        importance_cap=2.0,
    ).loss


def close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, name: str
) -> None:
    """``assert_close`` whose message names the parameter."""
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=rtol, msg=lambda text: f"{name}: {text}"
    )


def job_config(optimizer: str = "adamw") -> JobConfig:
    return JobConfig.model_validate(
        {
            "phase": "rl",
            "model": {"compute_dtype": "float32", "experts_precision": "fp32"},
            "optimizer": {"name": optimizer, "lr": 1e-2, "max_grad_norm": 0.5, "muon_lr": 1e-2},
            "rl": {"kl_coef": 0.0, "generation_budget_tokens": 60, "microbatch_tokens": 96},
        }
    )


def check_muon(runtime: Runtime, microbatches: list[object]) -> None:
    """Two Muon steps (hidden matrices and expert stacks orthogonalized whole, the rest on
    AdamW) give the single-process weights."""
    items = batch_items()
    job = job_config("muon")
    single = Learner(decisive_model(), job)
    learner = Learner(
        parallelize(decisive_model(), runtime.meshes, runtime.device), job, runtime=runtime
    )
    whole = [pack_microbatch(items, ARCH.num_layers, ARCH.top_k)]
    for step in range(2):
        single_metrics = single.rl_step(RLBatch(whole, 8, [], [], []), step)
        metrics = learner.rl_step(RLBatch(microbatches, 8, [], [], []), step)  # type: ignore[arg-type]
        assert metrics["loss"] == pytest.approx(single_metrics["loss"], rel=1e-4), step
    single_weights = dict(single.model.named_parameters())
    initial = dict(decisive_model().named_parameters())
    for name, param in learner.model.named_parameters():
        expected = single_weights[name].detach()
        actual = param.full_tensor().detach()
        if not muon_parameter(name, param):  # AdamW's, as in check_layout: within lr
            close(actual, expected, 2 * job.optimizer.lr, 0.0, name)
            continue
        # Newton-Schulz runs in bfloat16 (torch's iteration) on updates whose float32
        # gradients differ from the single process's in summation order only, so the
        # steps agree to bfloat16 roundings of themselves: within 3 % of the step in norm
        # and 5 % of its largest entry (measured over these layouts: at most 1.5 % and
        # 2.2 %; the Newton-Schulz iteration amplifies bfloat16's 0.4 % rounding).
        step = expected - initial[name].detach()
        difference = actual - expected
        assert float(step.norm()) > 0, name
        relative = float(difference.norm() / step.norm())
        assert relative < 0.03, f"{name}: the step is {relative:.2%} off in norm"
        close(actual, expected, float(0.05 * step.abs().max()), 0.0, name)


def check_layout(runtime: Runtime) -> None:
    layout = runtime.layout
    items = batch_items()
    reference = decisive_model()
    reference_loss = loss_of(reference, pack_microbatch(items, ARCH.num_layers, ARCH.top_k))
    reference_loss.backward()

    model = parallelize(decisive_model(), runtime.meshes, runtime.device)
    parts = assign(items, layout, CostModel(1.0, 0.01), token_budget=96)
    assert sorted(id(item) for part in parts for mb in part for item in mb) == sorted(
        id(item) for item in items
    ), "every sequence goes to exactly one dp replica"
    assert len({len(part) for part in parts}) == 1, "every replica runs as many microbatches"
    microbatches = local_microbatches(
        parts[runtime.dp_index],
        layout,
        runtime.cp_index,
        num_layers=ARCH.num_layers,
        top_k=ARCH.top_k,
    )
    local_loss = 0.0
    for microbatch in microbatches:
        loss = loss_of(model, microbatch)
        loss.backward()
        local_loss += float(loss.detach())
    total = runtime.all_reduce([local_loss])[0]
    assert total == pytest.approx(float(reference_loss.detach()), rel=1e-5, abs=1e-7)
    reference_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        whole = param.grad.full_tensor()
        expected = reference_grads[name].grad
        assert expected is not None
        close(whole, expected, GRAD_ATOL, GRAD_RTOL, name)

    # One learner step each way: same metrics, same weights after the update.
    job = job_config()
    single = Learner(decisive_model(), job)
    single_metrics = single.rl_step(
        RLBatch([pack_microbatch(items, ARCH.num_layers, ARCH.top_k)], 8, [], [], []), 0
    )
    learner = Learner(
        parallelize(decisive_model(), runtime.meshes, runtime.device), job, runtime=runtime
    )
    metrics = learner.rl_step(RLBatch(microbatches, 8, [], [], []), 0)
    for name in ("loss", "entropy", "is_ratio_mean", "is_ratio_max", "grad_norm"):
        assert metrics[name] == pytest.approx(single_metrics[name], rel=1e-4), name
    for name in ("tokens", "tokens_trained", "replay_token_fraction", "replay_replacement_rate"):
        assert metrics[name] == single_metrics[name], name
    assert single_metrics["replay_replacement_rate"] > 0, "the filter acted on implausible routes"
    # A first AdamW step moves each weight by lr·g/(|g| + eps). Where |g| ≫ eps that is a
    # full step of ±lr, which float32 rounding in g cannot change: the weights must agree
    # to 1e-5. Where |g| is near eps (1e-8), the order of a sum can change the step by up
    # to lr itself (one lm_head weight moved 1.3e-5 apart on an AVX-512 machine): there
    # the bound is lr, and such weights must be rare.
    lr = single_metrics["lr"]
    initial = dict(decisive_model().named_parameters())
    single_weights = dict(single.model.named_parameters())
    partial = total = 0
    for name, param in learner.model.named_parameters():
        expected = single_weights[name].detach()
        full_step = (expected - initial[name].detach()).abs() >= 0.999 * lr
        actual = param.full_tensor().detach()
        close(actual[full_step], expected[full_step], 1e-5, 1e-5, name)
        close(actual, expected, lr, 0.0, name)
        partial += int((~full_step).sum())
        total += full_step.numel()
    assert partial < 0.1 * total, f"{partial} of {total} weights took less than a full step"
    check_muon(runtime, microbatches)


def _worker(rank: int, world_size: int, port: int, dp: int, cp: int, ep: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    layout = ParallelLayout.resolve(world_size, dp=dp, cp=cp, ep=ep, num_experts=ARCH.num_experts)
    runtime = start(layout, backend="gloo", timeout_s=120, info=ProcessInfo(rank, rank, world_size))
    try:
        check_layout(runtime)
    finally:
        runtime.close()


def spawn(world_size: int, dp: int, cp: int, ep: int) -> None:
    """Runs ``_worker`` in ``world_size`` processes; a failure in any fails the caller."""
    mp.spawn(_worker, args=(world_size, free_port(), dp, cp, ep), nprocs=world_size, join=True)


@pytest.mark.parametrize(
    ("dp", "cp", "ep"),
    [(2, 1, 1), (1, 2, 1), (2, 1, 2)],
    ids=["dp2", "cp2", "ep2"],
)
@pytest.mark.slow
def test_two_process_layouts_match_one_process(dp: int, cp: int, ep: int) -> None:
    spawn(2, dp, cp, ep)


@pytest.mark.slow
def test_dp2_x_cp2_with_experts_over_all_four_ranks_matches_one_process() -> None:
    spawn(4, 2, 2, 4)


def test_a_step_with_nothing_to_train_leaves_the_weights_alone() -> None:
    learner = Learner(decisive_model(), job_config())
    learner.rl_step(
        RLBatch([pack_microbatch(batch_items(), ARCH.num_layers, ARCH.top_k)], 8, [], [], []), 0
    )
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    # All groups skipped; as on an idle rank, a microbatch with no trained token still runs
    # (zero gradients, not none): AdamW's momentum from the first step must not move anything.
    idle = [
        (replace(segment, trained=[False] * len(segment.trained)), 0.0, 1.0)
        for segment, _, _ in batch_items()[:2]
    ]
    metrics = learner.rl_step(
        RLBatch([pack_microbatch(idle, ARCH.num_layers, ARCH.top_k)], 0, [], [], []), 1
    )
    assert metrics["grad_norm"] == 0.0 and metrics["tokens_trained"] == 0
    for name, param in learner.model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
