"""The routed-experts wire format: one definition for inference, envs and the trainer.

``common.RoutedExperts`` carries the expert indices the routers chose, one row per
token: ``shape`` is ``[rows, num_moe_layers, top_k]``, ``data`` the indices packed
little-endian in row-major order, ``dtype`` their width. A message fits a sequence of
``num_tokens`` tokens when it has a row for every token, or for every token but the
last (that token is never fed to the model, so nothing routed it). A row of -1 means
"no routing recorded": the trainer's own router decides for that token.

A Generate answer's table may start past position 0 (``routed_experts_start``: the rows
the caller already holds are not sent again); it then fits the tokens from that
position on. Inference encodes (``encode``); envs checks each answer (``check``) and
joins a context's answers into the rollout record's table (``join``: their bytes
concatenated, never decoded, unless their index widths differ); the trainer decodes
(``decode``). A message
that does not fit raises ``RoutedExpertsError``, an ``InvalidArgument``: a servicer
answers it with INVALID_ARGUMENT, and its ``reason`` labels the trainer's skip metric.
"""

from __future__ import annotations

import math

import numpy as np

from services.api.v1 import common_pb2
from services.wire.errors import InvalidArgument

INDEX_DTYPES: dict[int, np.dtype] = {
    common_pb2.INDEX_DTYPE_UINT8: np.dtype("<u1"),
    common_pb2.INDEX_DTYPE_INT16: np.dtype("<i2"),
    common_pb2.INDEX_DTYPE_INT32: np.dtype("<i4"),
}


class RoutedExpertsError(InvalidArgument):
    """A routed-experts message that does not fit; ``reason`` is ``routed_experts_dtype``
    or ``routed_experts_shape``."""

    def __init__(self, reason: str, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.reason = reason


def is_empty(routed: common_pb2.RoutedExperts) -> bool:
    """The message carries no table (routing was not asked for, or not recorded)."""
    return not routed.data and not routed.shape


def encode(table: np.ndarray) -> common_pb2.RoutedExperts:
    """A ``[rows, layers, top_k]`` integer table in the narrowest index dtype that holds it."""
    if table.ndim != 3:
        raise ValueError(f"routed experts must be [rows, layers, top_k], got shape {table.shape}")
    low, high = (int(table.min()), int(table.max())) if table.size else (0, 0)
    if low >= 0 and high < 2**8:
        dtype = common_pb2.INDEX_DTYPE_UINT8
    elif low >= -(2**15) and high < 2**15:
        dtype = common_pb2.INDEX_DTYPE_INT16
    else:
        dtype = common_pb2.INDEX_DTYPE_INT32
    data = np.ascontiguousarray(table, dtype=INDEX_DTYPES[dtype]).tobytes()
    return common_pb2.RoutedExperts(data=data, shape=list(table.shape), dtype=dtype)


def check(
    routed: common_pb2.RoutedExperts, num_tokens: int, field: str = "routed_experts"
) -> np.dtype:
    """Checks the header against ``num_tokens`` without reading the indices; returns the
    index dtype. Raises ``RoutedExpertsError`` naming ``field`` when it does not fit."""
    dtype = INDEX_DTYPES.get(routed.dtype)
    if dtype is None:
        raise RoutedExpertsError(
            "routed_experts_dtype",
            f"{field}.dtype",
            f"index dtype {routed.dtype} is not known (uint8, int16 or int32)",
        )
    shape = tuple(routed.shape)
    if len(shape) != 3:
        raise RoutedExpertsError(
            "routed_experts_shape", f"{field}.shape", f"{shape}, expected [tokens, layers, top_k]"
        )
    if shape[0] not in (num_tokens, num_tokens - 1):
        raise RoutedExpertsError(
            "routed_experts_shape",
            f"{field}.shape",
            f"{shape[0]} token rows for {num_tokens} tokens (expected {num_tokens}, or "
            f"{num_tokens - 1} without the last token's)",
        )
    if len(routed.data) != math.prod(shape) * dtype.itemsize:
        raise RoutedExpertsError(
            "routed_experts_shape",
            f"{field}.data",
            f"{len(routed.data)} bytes for shape {shape} of {dtype.name}",
        )
    return dtype


def decode(
    routed: common_pb2.RoutedExperts, num_tokens: int, field: str = "routed_experts"
) -> np.ndarray | None:
    """The checked ``[rows, layers, top_k]`` table as int64; None when the message is empty."""
    if is_empty(routed):
        return None
    dtype = check(routed, num_tokens, field)
    table = np.frombuffer(routed.data, dtype=dtype).reshape(tuple(routed.shape))
    return table.astype(np.int64)


def join(
    parts: list[common_pb2.RoutedExperts], field: str = "routed_experts"
) -> common_pb2.RoutedExperts:
    """One table of ``parts``' rows in order, their bytes forwarded as they came. Parts of
    different index widths are widened to the widest (a -1 row, say, makes one call's
    table int16 beside another's uint8); rows of other ``[layers, top_k]`` raise
    ``RoutedExpertsError`` naming ``field``."""
    if not parts:
        raise ValueError("join needs at least one table")
    widths = {part.dtype: INDEX_DTYPES[part.dtype] for part in parts}
    row_shapes = {tuple(part.shape[1:]) for part in parts}
    if len(row_shapes) != 1:
        raise RoutedExpertsError(
            "routed_experts_shape",
            f"{field}.shape",
            f"rows of shapes {sorted(row_shapes)} in one context (one [layers, top_k] expected)",
        )
    widest = max(widths, key=lambda dtype: widths[dtype].itemsize)
    if len(widths) == 1:
        data = b"".join(part.data for part in parts)
    else:
        wide = INDEX_DTYPES[widest]
        data = b"".join(
            np.frombuffer(part.data, dtype=INDEX_DTYPES[part.dtype]).astype(wide).tobytes()
            for part in parts
        )
    rows = sum(part.shape[0] for part in parts)
    return common_pb2.RoutedExperts(data=data, shape=[rows, *row_shapes.pop()], dtype=widest)
