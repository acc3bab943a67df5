"""Prefix-shared packing: sequences that begin alike are packed as a tree of token runs.

Every rollout of an RL step starts with the same system prompt, and the K rollouts of a
group with the same task as well; SFT examples share the system prompt too. Packed one
after another, each sequence recomputes those tokens. Packed as a *prefix tree*, a
token position that several sequences hold alike is computed once:

* the stream holds the tree's nodes in depth-first order, cut into *runs* (maximal
  chains without a branch), so every run is a contiguous slice of the stream;
* a token's position id is its depth in the tree (its position in every sequence that
  holds it);
* a run attends to the keys of its *ancestor runs* (all of them: a run only branches
  off at its parent's last token) and causally to its own.

Each sequence's computation is then exactly what it was packed alone: the same tokens at
the same positions with the same keys before them. Two sequences share a position only
where the token, everything before it and its replayed routing are equal, and where at
most one of them trains it: a shared token's output can serve one target, and the
others pass through it untrained (their loss at that position is not taken). The
gradients of the shared tokens are the sums of what each sequence sends back through
them, which is the gradient of the unshared batch up to the order of float additions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PrefixTree:
    """How a packed stream of shared prefixes maps back to its sequences.

    ``source[t]`` is the index, into the sequences' concatenated tokens, of the token
    whose per-token data (target, trained flag, behaviour logprob...) stream token ``t``
    carries: the sequence that trains it, or the first that holds it.
    """

    source: torch.Tensor  # [T] int64 index into the concatenation of the sequences
    position_ids: torch.Tensor  # [T] int64: depth in the tree
    cu_runs: list[int]  # [R + 1] run boundaries in the stream
    ancestors: list[list[int]]  # per run, the runs above it (root first)

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream."""
        return int(self.source.shape[0])


def _replay_keys(replay: torch.Tensor | None, length: int) -> list[bytes]:
    if replay is None:
        return [b""] * length
    rows = replay.to(torch.int16).reshape(length, -1).numpy()
    return [row.tobytes() for row in rows]


def build_prefix_tree(
    sequences: Sequence[Sequence[int]],
    trained: Sequence[Sequence[bool]],
    replay: Sequence[torch.Tensor | None] | None = None,
) -> PrefixTree:
    """The prefix tree of ``sequences`` (token ids; ``trained[i][j]`` marks position ``j``
    of sequence ``i`` as a trained target; ``replay[i]`` its routing rows, ``[len, ...]``)."""
    if len(trained) != len(sequences):
        raise ValueError(f"{len(trained)} trained masks for {len(sequences)} sequences")
    if replay is not None and len(replay) != len(sequences):
        raise ValueError(f"{len(replay)} replay entries for {len(sequences)} sequences")
    # One node per distinct shared position: its depth, source token, whether a sequence
    # already trains it, and its children. ``index`` finds a node by (parent, token, routing).
    depth: list[int] = []
    source: list[int] = []
    owned: list[bool] = []
    children: list[list[int]] = []
    roots: list[int] = []
    index: dict[tuple[int, int, bytes], int] = {}
    offset = 0
    for number, tokens in enumerate(sequences):
        flags = trained[number]
        if len(flags) != len(tokens):
            raise ValueError(
                f"sequence {number}: {len(flags)} trained flags for {len(tokens)} tokens"
            )
        keys = _replay_keys(None if replay is None else replay[number], len(tokens))
        above = -1
        for position, token in enumerate(tokens):
            key = (above, int(token), keys[position])
            node = index.get(key)
            if node is not None and not (flags[position] and owned[node]):
                if flags[position]:
                    owned[node] = True
                    source[node] = offset + position
                above = node
                continue
            node = len(depth)
            depth.append(position)
            source.append(offset + position)
            owned.append(bool(flags[position]))
            children.append([])
            (children[above] if above >= 0 else roots).append(node)
            index[key] = node
            above = node
        offset += len(tokens)
    # Depth-first order; a run is a chain of nodes with one child each.
    order: list[int] = []
    cu_runs = [0]
    ancestors: list[list[int]] = []
    stack = [(root, list[int]()) for root in reversed(roots)]
    while stack:
        node, above_runs = stack.pop()
        run = len(ancestors)
        ancestors.append(above_runs)
        while True:
            order.append(node)
            if len(children[node]) != 1:
                break
            node = children[node][0]
        cu_runs.append(len(order))
        below = [*above_runs, run]
        stack.extend((child, below) for child in reversed(children[node]))
    return PrefixTree(
        source=torch.tensor([source[node] for node in order], dtype=torch.long),
        position_ids=torch.tensor([depth[node] for node in order], dtype=torch.long),
        cu_runs=cu_runs,
        ancestors=ancestors,
    )
