"""Muon for matrices and expert stacks (``services.trainer.muon.MatrixMuon``): torch's
update exactly, per matrix; the sharded case is in tests/test_dist_layouts.py."""

from __future__ import annotations

import pytest
import torch

from services.trainer.muon import MatrixMuon


def _gradients(shape: tuple[int, ...], steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=generator) for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(16, 8), (8, 24)])
def test_a_matrix_moves_exactly_as_torch_muon_moves_it(
    shape: tuple[int, int], nesterov: bool
) -> None:
    start = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov}
    reference = torch.optim.Muon([theirs], **settings)  # type: ignore[arg-type]
    optimizer = MatrixMuon([ours], **settings)  # type: ignore[arg-type]
    for grad in _gradients(shape, 3):
        theirs.grad, ours.grad = grad.clone(), grad.clone()
        reference.step()
        optimizer.step()
        assert torch.equal(ours, theirs)
    assert not torch.equal(ours, start)


def test_an_expert_stack_moves_as_each_expert_matrix_would_alone() -> None:
    # [experts, out, in]: each expert's matrix is orthogonalized on its own, its learning
    # rate adjusted by the matrix's shape (not by the stack's first two sizes).
    start = torch.randn(4, 24, 8, generator=torch.Generator().manual_seed(0))
    stack = torch.nn.Parameter(start.clone())
    experts = [torch.nn.Parameter(matrix.clone()) for matrix in start]
    reference = torch.optim.Muon(experts, lr=0.02, weight_decay=0.1)
    optimizer = MatrixMuon([stack], lr=0.02, weight_decay=0.1)
    for grad in _gradients((4, 24, 8), 3):
        stack.grad = grad.clone()
        for expert, expert_grad in zip(experts, grad, strict=True):
            expert.grad = expert_grad.clone()
        reference.step()
        optimizer.step()
        assert torch.equal(stack.detach(), torch.stack([e.detach() for e in experts]))


def test_only_matrices_and_stacks() -> None:
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        MatrixMuon([torch.nn.Parameter(torch.zeros(8))], lr=0.02)
    with pytest.raises(ValueError, match=r"lr \(-1\.0\)"):
        MatrixMuon([torch.nn.Parameter(torch.zeros(2, 2))], lr=-1.0)
