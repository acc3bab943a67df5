"""Router replay: exact routes from another forward, gates from the router, the filter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.model import PackedInputs, Router, filter_replay, load_pretrained
from tests.trainer_support import sharpen_model


@pytest.fixture(scope="module")
def sharp_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharpen_model(tiny_model, tmp_path_factory.mktemp("sharp") / "tiny-sharp")


def _stream(lengths: tuple[int, ...] = (60, 60, 60, 60)) -> PackedInputs:
    generator = torch.Generator().manual_seed(0)
    return PackedInputs.pack(
        [torch.randint(16, 985, (n,), generator=generator).tolist() for n in lengths]
    )


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, layers] True where the two routings chose the same experts (in any order)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def test_replaying_bf16_routes_makes_an_fp32_forward_route_identically(sharp_model: Path) -> None:
    inputs = _stream()
    with torch.no_grad():
        bf16 = load_pretrained(sharp_model, dtype=torch.bfloat16)(inputs)
        fp32 = load_pretrained(sharp_model, dtype=torch.float32)
        free = fp32(inputs)
        replayed = fp32(
            PackedInputs(inputs.input_ids, inputs.position_ids, inputs.cu_seqlens, bf16.experts)
        )
    # Without replay, rounding flips near-tied routes: the two forwards are different networks.
    assert not bool(_same_sets(free.experts, bf16.experts).all())
    assert bool(_same_sets(replayed.experts, bf16.experts).all())
    assert replayed.num_replaced == [0, 0]
    assert replayed.num_replayed == inputs.input_ids.shape[0]


def test_replay_in_a_packed_stream_applies_only_where_the_mask_says(sharp_model: Path) -> None:
    model = load_pretrained(sharp_model, dtype=torch.float32)
    inputs = _stream((5, 4))
    with torch.no_grad():
        own = model(inputs).experts
    # Send every token of the first sequence to the router's last choices instead.
    forced = own.flip(-1).clone()
    forced[:, :, 0] = (own[:, :, 0] + 1) % model.arch.num_experts
    forced[:, :, 1] = (own[:, :, 0] + 2) % model.arch.num_experts
    replay = [forced[:5], None]
    packed = PackedInputs.pack(
        [inputs.input_ids[:5].tolist(), inputs.input_ids[5:].tolist()],
        replay,
        num_layers=model.arch.num_layers,
        top_k=model.arch.top_k,
    )
    model.replay_min_prob_ratio = 0.0  # keep every replayed choice
    with torch.no_grad():
        out = model(packed)
    assert torch.equal(out.experts[:5, 0], forced[:5, 0])
    assert out.num_replayed == 5
    # The second sequence has no replay data: the router decides for it (layer 0 sees the
    # same inputs as before, so it routes as before).
    assert torch.equal(out.experts[5:, 0], own[5:, 0])


def test_gates_are_the_routers_renormalized_probabilities_and_it_gets_gradients() -> None:
    router = Router(hidden_size=4, num_experts=4, top_k=2)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    decision = router(x, replay=torch.tensor([[2, 1]]), min_prob_ratio=0.0)
    probs = torch.softmax(x, dim=-1)[0]
    assert decision.experts.tolist() == [[2, 1]]
    expected = torch.stack([probs[2], probs[1]]) / (probs[2] + probs[1])
    torch.testing.assert_close(decision.weights[0], expected)
    (decision.weights[0, 0] * 3.0).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_the_filter_replaces_implausible_and_duplicate_choices_with_the_routers_best() -> None:
    probs = torch.tensor(
        [
            [0.40, 0.30, 0.20, 0.09, 0.01],  # k-th largest 0.30; threshold 0.5 * 0.30 = 0.15
            [0.40, 0.30, 0.20, 0.09, 0.01],
            [0.40, 0.30, 0.20, 0.09, 0.01],
        ]
    )
    replayed = torch.tensor([[2, 4], [3, 1], [2, 2]])
    kth = probs.topk(2).values[:, -1]
    experts, replaced = filter_replay(probs, replayed, kth, min_prob_ratio=0.5)
    # Row 0: expert 4 (0.01) is implausible -> the best not chosen, expert 0.
    # Row 1: expert 3 (0.09) is implausible -> expert 0. Row 2: the duplicate -> expert 0.
    assert experts.tolist() == [[2, 0], [0, 1], [2, 0]]
    assert replaced.tolist() == [[False, True], [True, False], [False, True]]
    # A looser filter keeps what inference chose.
    kept, none_replaced = filter_replay(probs, replayed[:2], kth[:2], min_prob_ratio=0.01)
    assert kept.tolist() == replayed[:2].tolist() and not bool(none_replaced.any())


def test_the_model_counts_replacements_per_layer(sharp_model: Path) -> None:
    model = load_pretrained(sharp_model, dtype=torch.float32, replay_min_prob_ratio=0.5)
    inputs = _stream((30,))
    with torch.no_grad():
        router_choice = model(inputs).experts
        # Keep the router's second choice, swap its first for an arbitrary other expert:
        # often one the router gives little probability.
        arbitrary = router_choice.clone()
        arbitrary[:, :, 0] = (router_choice[:, :, 0] + 3) % model.arch.num_experts
        out = model(
            PackedInputs(inputs.input_ids, inputs.position_ids, inputs.cu_seqlens, arbitrary)
        )
    assert len(out.num_replaced) == model.arch.num_layers
    assert all(count > 0 for count in out.num_replaced)
    assert all(count <= 30 * model.arch.top_k for count in out.num_replaced)
