"""Tensor codec: XOR of the raw bits against a base, framed sparsely, then zstd.

A tensor is handled as its raw bits (bf16/fp16 as uint16, fp32 as uint32, fp8 as
uint8), so decoding is bit-exact for every value, NaN payloads included. Encodings:

* ``raw`` (keyframes): the bits, byte-planes shuffled (all high bytes, then all low
  bytes: exponents and mantissas compress separately), then zstd.
* ``xor_sparse`` (deltas): ``x = bits ^ base``. An RL step changes about 1% of a bf16
  tensor, so ``x`` is mostly zero; it is stored as the positions of its nonzero words
  (varint gaps) and those words (byte-planes shuffled), each zstd-compressed. This is a
  lossless framing of the XOR stream: several times smaller than zstd over the
  mostly-zero stream, and it runs near memory speed (``services.weights.kernels``).
* ``xor_dense`` (deltas that changed much): the XOR words shuffled, then zstd.
"""

from __future__ import annotations

import struct
import threading
from typing import Final, Literal

import numpy as np
import torch
import zstandard

from services.weights import kernels

Encoding = Literal["raw", "xor_sparse", "xor_dense"]

# name in the manifest -> (torch dtype, unsigned integer dtype of the same width)
DTYPES: Final[dict[str, tuple[torch.dtype, np.dtype]]] = {
    "bf16": (torch.bfloat16, np.dtype(np.uint16)),
    "fp16": (torch.float16, np.dtype(np.uint16)),
    "fp32": (torch.float32, np.dtype(np.uint32)),
    "fp8_e4m3": (torch.float8_e4m3fn, np.dtype(np.uint8)),
    "fp8_e5m2": (torch.float8_e5m2, np.dtype(np.uint8)),
}
DTYPE_NAMES: Final[dict[torch.dtype, str]] = {t: name for name, (t, _) in DTYPES.items()}
_TORCH_UINT: Final[dict[int, torch.dtype]] = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}
# Above this fraction of changed words the dense framing is smaller than the sparse one.
DENSE_ABOVE: Final = 0.3
# xor_sparse payload: number of changed words, compressed gap bytes, then the two frames.
_HEADER = struct.Struct("<QQ")


class CodecError(ValueError):
    """Bytes that do not decode to the tensor the manifest describes."""


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a supported dtype; TypeError for others."""
    if dtype not in DTYPE_NAMES:
        supported = ", ".join(str(t) for t in DTYPE_NAMES)
        raise TypeError(
            f"dtype {dtype} is not supported by the weight codec (supported: {supported})"
        )
    return DTYPE_NAMES[dtype]


def to_bits(tensor: torch.Tensor) -> np.ndarray:
    """The raw bits of a CPU tensor as a flat unsigned-integer array (no copy when contiguous)."""
    name = dtype_name(tensor.dtype)
    width = DTYPES[name][1].itemsize
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_TORCH_UINT[width]).numpy()


def from_bits(bits: np.ndarray, dtype_label: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `dtype_label` and `shape` over the raw bits (shares memory with `bits`)."""
    if dtype_label not in DTYPES:
        raise CodecError(f"unknown dtype {dtype_label!r} (known: {', '.join(DTYPES)})")
    torch_dtype, uint = DTYPES[dtype_label]
    expected = int(np.prod(shape, dtype=np.int64))
    if bits.dtype != uint or bits.size != expected:
        raise CodecError(
            f"{bits.size} {bits.dtype} words do not make a {dtype_label} tensor of shape {shape}"
        )
    return torch.from_numpy(bits).view(torch_dtype).reshape(shape)


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A per-thread compressor (they are not thread-safe, and costly to build per tensor).

    Frame checksums are on: a damaged payload is an error, not wrong bits.
    """
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    decompressor: zstandard.ZstdDecompressor = _local.decompressor
    return decompressor


def _shuffle(words: np.ndarray) -> bytes:
    if words.itemsize == 1:
        return words.tobytes()
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, words.itemsize).T).tobytes()


def _unshuffle(data: bytes, uint: np.dtype, count: int) -> np.ndarray:
    planes = np.frombuffer(data, dtype=np.uint8)
    if planes.size != count * uint.itemsize:
        raise CodecError(f"expected {count * uint.itemsize} bytes of words, got {planes.size}")
    if uint.itemsize == 1:
        return planes.copy()
    return np.ascontiguousarray(planes.reshape(uint.itemsize, count).T).view(uint).reshape(count)


def encode(bits: np.ndarray, base: np.ndarray | None, level: int = 1) -> tuple[Encoding, bytes]:
    """Encodes `bits`, against `base` (same dtype and size) when given."""
    compressor = _compressor(level)
    if base is None:
        return "raw", compressor.compress(_shuffle(bits))
    if base.dtype != bits.dtype or base.size != bits.size:
        raise CodecError(
            f"base of {base.size} {base.dtype} words for {bits.size} {bits.dtype} words"
        )
    capacity = int(bits.size * DENSE_ABOVE)
    values = np.empty(capacity, dtype=bits.dtype)
    # Varint gaps: one byte per change, plus at most 4 more for each gap >= 128.
    gaps = np.empty(capacity + 4 * (bits.size // 128) + 16, dtype=np.uint8)
    current_words, per_word = kernels.word_views(bits)
    base_words, _ = kernels.word_views(base)
    count, gap_bytes = kernels.xor_gaps_encode(
        bits, base, current_words, base_words, per_word, gaps, values
    )
    if count < 0:
        return "xor_dense", compressor.compress(_shuffle(np.bitwise_xor(bits, base)))
    gap_frame = compressor.compress(gaps[:gap_bytes].tobytes())
    value_frame = compressor.compress(_shuffle(values[:count]))
    return "xor_sparse", _HEADER.pack(count, len(gap_frame)) + gap_frame + value_frame


def decode(
    encoding: str, payload: bytes, base: np.ndarray | None, uint: np.dtype, count: int
) -> np.ndarray:
    """The bits `encode` was given (a new array; `base` is not modified)."""
    decompressor = _decompressor()
    try:
        if encoding == "raw":
            return _unshuffle(decompressor.decompress(payload), uint, count)
        if base is None:
            raise CodecError(f"{encoding} needs the base version's tensor")
        if base.size != count or base.dtype != uint:
            raise CodecError(f"base of {base.size} {base.dtype} words for {count} {uint} words")
        if encoding == "xor_dense":
            return np.bitwise_xor(base, _unshuffle(decompressor.decompress(payload), uint, count))
        if encoding == "xor_sparse":
            count, gap_length = _HEADER.unpack_from(payload)
            gaps_end = _HEADER.size + gap_length
            gaps = np.frombuffer(
                decompressor.decompress(payload[_HEADER.size : gaps_end]), np.uint8
            )
            values = _unshuffle(decompressor.decompress(payload[gaps_end:]), uint, count)
            bits = base.copy()
            if kernels.xor_gaps_apply(bits, gaps, values) != gaps.size:
                raise CodecError("corrupt xor_sparse payload: positions do not fit the tensor")
            return bits
    except (zstandard.ZstdError, struct.error) as error:
        raise CodecError(f"corrupt {encoding} payload: {error}") from error
    raise CodecError(f"unknown encoding {encoding!r} (known: raw, xor_sparse, xor_dense)")
