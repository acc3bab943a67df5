"""Prefix-shared packing: the tree's layout, and a step on it equals a step on whole sequences."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from services.config.trainer import JobConfig
from services.trainer.batch import RLBatch, TrainItem, pack_microbatch
from services.trainer.distributed.context_parallel import shard_inputs
from services.trainer.learner import Learner
from services.trainer.model import PackedInputs, load_pretrained, token_logprobs
from services.trainer.model.layers import causal_attention
from services.trainer.model.prefix_tree import build_prefix_tree
from services.trainer.rollouts import SegmentTokens
from services.trainer.sft import Example, to_microbatch
from tests.trainer_support import sample, sharpen_model


@pytest.fixture(scope="module")
def sharp_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharpen_model(tiny_model, tmp_path_factory.mktemp("sharp") / "tiny-sharp")


def test_sequences_that_begin_alike_share_their_common_untrained_tokens() -> None:
    system, task_a, task_b = [5, 6, 7, 8], [20, 21], [30]
    sequences = [
        system + task_a + [1, 2, 3],
        system + task_a + [1, 9],  # same first generated token, trained in both: not shared
        system + task_b + [4],
        [99, 98],  # nothing in common
    ]
    trained = [[False] * (len(s) - 3) + [True] * 3 for s in sequences[:2]]
    trained += [[False] * 4 + [True] * 2, [False, True]]
    tree = build_prefix_tree(sequences, trained)

    # Runs, depth first in the order the sequences came: the system prompt; task a's shared
    # part; its two continuations; task b's branch; the unrelated sequence.
    lengths = [end - start for start, end in zip(tree.cu_runs, tree.cu_runs[1:], strict=False)]
    assert lengths == [4, 2, 3, 2, 2, 2]
    assert tree.ancestors == [[], [0], [0, 1], [0, 1], [0], []]
    assert tree.num_tokens == 15
    # Positions are depths: a continuation starts where its prefix ends.
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 4, 5, 0, 1]
    # Each stream token carries the data of the first sequence holding it, or of the one
    # that trains it (token 21 is trained by the second sequence: source 9 + 5).
    assert tree.source.tolist() == [0, 1, 2, 3, 4, 14, 6, 7, 8, 15, 16, 21, 22, 23, 24]
    flat = [token for sequence in sequences for token in sequence]
    assert [flat[s] for s in tree.source.tolist()] == [
        5,
        6,
        7,
        8,
        20,
        21,
        1,
        2,
        3,
        1,
        9,
        30,
        4,
        99,
        98,
    ]


def test_a_position_trained_by_one_sequence_is_shared_with_one_that_only_reads_it() -> None:
    """An SFT transcript's first turn (trained) is the second turn's context (not trained)."""
    first = [1, 2, 3, 4]
    second = [1, 2, 3, 4, 5, 6]
    tree = build_prefix_tree([first, second], [[False, True, True, True], [False] * 4 + [True] * 2])
    assert tree.num_tokens == 6
    assert tree.source.tolist() == [0, 1, 2, 3, 8, 9]


def test_different_replayed_routing_keeps_tokens_apart() -> None:
    tokens = [[3, 4, 5], [3, 4, 6]]
    trained = [[False, False, True]] * 2
    same = torch.zeros(3, 2, 2, dtype=torch.long)
    other = same.clone()
    other[1, 0, 0] = 1
    assert build_prefix_tree(tokens, trained, [same, same]).num_tokens == 4
    assert build_prefix_tree(tokens, trained, [same, other]).num_tokens == 5
    with pytest.raises(ValueError, match="2 trained masks for 1 sequences"):
        build_prefix_tree([[1, 2]], trained)


def test_attention_over_a_tree_equals_attention_of_each_sequence_alone() -> None:
    generator = torch.Generator().manual_seed(3)
    prefix = 6
    continuations = [4, 1, 5]
    sequences = [list(range(prefix)) + [100 + i] * n for i, n in enumerate(continuations)]
    tree = build_prefix_tree(sequences, [[False] * prefix + [True] * n for n in continuations])
    num_flat = sum(len(sequence) for sequence in sequences)
    query = torch.randn(num_flat, 4, 8, generator=generator)
    key = torch.randn(num_flat, 2, 8, generator=generator)
    value = torch.randn(num_flat, 2, 8, generator=generator)
    # The prefix's q/k/v are the same in every sequence, as they are in a real forward.
    starts = [0, prefix + 4, 2 * prefix + 5]
    for tensor in (query, key, value):
        for start in starts[1:]:
            tensor[start : start + prefix] = tensor[:prefix]
    grad = torch.randn(num_flat, 4, 8, generator=generator)
    # Where each token of the whole sequences sits in the tree's stream (the prefix copies
    # of every sequence all sit on the first sequence's).
    stream_index = {int(source): index for index, source in enumerate(tree.source)}
    copy_to_stream = torch.tensor(
        [
            stream_index[offset if offset < prefix else start + offset]
            for start, n in zip(starts, continuations, strict=True)
            for offset in range(prefix + n)
        ]
    )

    def gathered(values: torch.Tensor) -> torch.Tensor:
        """``values`` of the whole sequences summed onto the tree's tokens."""
        return torch.zeros(tree.num_tokens, *values.shape[1:]).index_add(0, copy_to_stream, values)

    flat = [t.clone().requires_grad_() for t in (query, key, value)]
    cu_flat = [0, *torch.tensor([prefix + n for n in continuations]).cumsum(0).tolist()]
    out_flat = causal_attention(*flat, cu_flat)
    out_flat.backward(grad)

    shared = [t[tree.source].clone().requires_grad_() for t in (query, key, value)]
    out_tree = causal_attention(*shared, tree.cu_runs, tree.ancestors)
    # In a model, a shared token's output gathers the gradients of all its copies.
    out_tree.backward(gathered(grad))
    torch.testing.assert_close(out_tree.detach(), out_flat.detach()[tree.source])
    for whole, tree_input in zip(flat, shared, strict=True):
        assert whole.grad is not None and tree_input.grad is not None
        torch.testing.assert_close(tree_input.grad, gathered(whole.grad), atol=1e-5, rtol=1e-5)


def _rollouts(model_dir: Path) -> list[TrainItem]:
    """Two groups of three sampled rollouts after one system prompt, with the sampler's
    logprobs and routing, and per-rollout advantages."""
    model = load_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    system = torch.randint(16, 900, (24,), generator=generator).tolist()
    tasks = [torch.randint(16, 900, (n,), generator=generator).tolist() for n in (6, 9)]
    prompts = [system + task for task in tasks for _ in range(3)]
    samples = sample(model, prompts, 10, generator)
    items: list[TrainItem] = []
    for index, item in enumerate(samples):
        tokens = item.prompt + item.completion
        num_untrained = len(item.prompt) - 1
        segment = SegmentTokens(
            input_ids=tokens[:-1],
            targets=tokens[1:],
            trained=[False] * num_untrained + [True] * len(item.completion),
            behaviour_logprobs=[0.0] * num_untrained + item.logprobs,
            replay=item.routed_experts[:-1],
        )
        items.append((segment, (index % 3) - 1.0, 1.0))
    return items


def _step(model_dir: Path, items: list[TrainItem], share: bool) -> tuple[dict, dict]:
    job = JobConfig.model_validate(
        {
            "phase": "rl",
            "model": {"compute_dtype": "float32"},
            # eps 1 makes the first Adam step about lr * g, so weights compare like gradients.
            "optimizer": {"lr": 1.0, "eps": 1.0},
            "rl": {"kl_coef": 0.1, "generation_budget_tokens": 64},
        }
    )
    model = load_pretrained(model_dir, dtype=torch.float32)
    learner = Learner(model, job, copy.deepcopy(model).requires_grad_(False))
    arch = model.arch
    microbatch = pack_microbatch(items, arch.num_layers, arch.top_k, share_prefixes=share)
    batch = RLBatch(
        [microbatch], num_rollouts=len(items), rewards=[], advantages=[], group_weights=[]
    )
    metrics = learner.rl_step(batch, 0)
    return metrics, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_an_rl_step_on_shared_prefixes_equals_one_on_whole_sequences(sharp_model: Path) -> None:
    items = _rollouts(sharp_model)
    whole, whole_weights = _step(sharp_model, items, share=False)
    shared, shared_weights = _step(sharp_model, items, share=True)
    # The system prompt once for six rollouts, each task once for three (all but its last
    # token, whose target is the rollout's first generated token).
    assert whole["tokens"] == shared["tokens"] == whole["tokens_computed"]
    num_flat = sum(len(segment.input_ids) for segment, _, _ in items)
    assert shared["tokens_computed"] == num_flat - 5 * 24 - 2 * (6 - 1) - 2 * (9 - 1)
    for name in ("loss", "loss_pg", "loss_kl", "kl", "entropy", "logprob_mismatch", "grad_norm"):
        assert shared[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-6), name
    assert whole["tokens_trained"] == shared["tokens_trained"] == 60
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(shared_weights[name], tensor, atol=1e-6, rtol=1e-4)


def test_sft_on_shared_prefixes_has_the_loss_and_gradients_of_whole_examples(
    sharp_model: Path,
) -> None:
    model = load_pretrained(sharp_model, dtype=torch.float32)
    prompt = list(range(40, 70))
    examples = [
        Example([*prompt, 71, 72, 73], [False] * 30 + [True] * 3),
        Example([*prompt, 71, 72, 73, 80, 81], [False] * 33 + [True] * 2),
        Example([*prompt[:10], 90, 91], [False] * 10 + [True] * 2),
    ]
    results = []
    for share in (False, True):
        model.zero_grad()
        microbatch = to_microbatch(examples, share_prefixes=share)
        output = model(microbatch.inputs)
        rows = microbatch.trained.nonzero()[:, 0]
        logprobs, _ = token_logprobs(model, output.hidden[rows], microbatch.targets[rows])
        logprobs.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(logprobs.detach().sum()), microbatch, grads))
    (whole_sum, whole_mb, whole_grads), (shared_sum, shared_mb, shared_grads) = results
    # The second example's context is the first example whole (trained there, read here);
    # the third shares the prompt's first ten tokens: 32 + 2 + 1 tokens in the tree.
    assert shared_mb.num_tokens == 35 and whole_mb.num_tokens == 32 + 34 + 11
    assert shared_mb.num_data_tokens == whole_mb.num_tokens
    assert shared_sum == pytest.approx(whole_sum, rel=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_prefix_sharing_applies_only_where_each_sequence_is_whole() -> None:
    def job(**fields: object) -> JobConfig:
        return JobConfig.model_validate({"phase": "rl", **fields})

    assert job().shares_prefixes
    assert not job(prefix_sharing="off").shares_prefixes
    assert not job(dist={"cp": 2}).shares_prefixes
    assert not job(model={"num_mtp_heads": 1}).shares_prefixes
    shared, _ = PackedInputs.pack_shared(
        [[1, 2, 3, 4], [1, 2, 5, 6]], [[False, False, True, True]] * 2
    )
    assert shared.shares_prefixes
    with pytest.raises(ValueError, match="prefix-shared stream"):
        shard_inputs(shared, 0, 2)


@pytest.mark.slow
def test_bench_prefix_sharing_contract() -> None:
    from services.bench.prefix_sharing import run

    answer = run(True).to_json("prefix-sharing")
    figures, details = answer["figures"], answer["details"]
    assert set(figures) == {
        "rl_step_speedup",
        "sft_step_speedup",
        "rl_computed_fraction",
        "sft_computed_fraction",
        "rl_step_seconds",
        "sft_step_seconds",
    }
    assert set(answer["baseline"]) == {"rl_step_seconds", "sft_step_seconds"}
    # The system prompt is about half of every sequence: the tree computes well under it.
    assert 0.2 < figures["rl_computed_fraction"] < 0.6
    assert 0.2 < figures["sft_computed_fraction"] < 0.6
    assert details["rl"]["rollouts"] == 32
    assert details["rl"]["loss_tree"] == pytest.approx(details["rl"]["loss_whole"], rel=0.05)
    assert details["sft"]["loss_tree"] == pytest.approx(details["sft"]["loss_whole"], rel=0.01)
