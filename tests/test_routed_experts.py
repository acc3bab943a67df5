"""The routed-experts wire format (services.routed_experts): round trip, what it refuses,
and envs forwarding inference's bytes into the rollout record unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from grpc import aio
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from services import routed_experts
from services.api.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.envs.harness import SegmentBuilder
from services.envs.inference_client import InferenceGenerator
from services.routed_experts import RoutedExpertsError
from services.wire.client import make_channel
from services.wire.errors import InvalidArgument
from services.wire.ports import free_port


@given(
    hnp.arrays(
        np.int64,
        hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=6),
        elements=st.integers(-1, 70_000),
    )
)
def test_a_table_round_trips_in_the_narrowest_dtype(table: np.ndarray) -> None:
    message = routed_experts.encode(table)
    decoded = routed_experts.decode(message, num_tokens=table.shape[0])
    assert decoded is not None and decoded.dtype == np.int64
    np.testing.assert_array_equal(decoded, table)
    expected = (
        common_pb2.INDEX_DTYPE_UINT8
        if table.min() >= 0 and table.max() < 256
        else common_pb2.INDEX_DTYPE_INT16
        if table.max() < 2**15
        else common_pb2.INDEX_DTYPE_INT32
    )
    assert message.dtype == expected


def test_a_table_may_leave_out_the_last_tokens_row_and_nothing_else() -> None:
    message = routed_experts.encode(np.zeros((4, 2, 2), dtype=np.int64))
    for num_tokens in (4, 5):
        assert routed_experts.decode(message, num_tokens) is not None
    for num_tokens in (3, 6):
        with pytest.raises(RoutedExpertsError, match="4 token rows for") as caught:
            routed_experts.decode(message, num_tokens)
        assert caught.value.reason == "routed_experts_shape"


def test_an_empty_message_is_no_table() -> None:
    assert routed_experts.decode(common_pb2.RoutedExperts(), num_tokens=7) is None


@pytest.mark.parametrize("dtype", [common_pb2.INDEX_DTYPE_UNSPECIFIED, 9])
def test_an_unknown_dtype_is_refused_not_guessed(dtype: int) -> None:
    message = common_pb2.RoutedExperts(data=bytes(16), shape=[2, 2, 1], dtype=dtype)  # type: ignore[arg-type]
    with pytest.raises(RoutedExpertsError, match=r"routed_experts\.dtype: index dtype") as caught:
        routed_experts.check(message, num_tokens=2)
    assert caught.value.reason == "routed_experts_dtype"
    assert isinstance(caught.value, InvalidArgument)  # a servicer answers INVALID_ARGUMENT
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("shape", "data_bytes", "field"),
    [
        ([2, 2], 4, "routed_experts.shape"),  # not [tokens, layers, top_k]
        ([2, 2, 2, 1], 8, "routed_experts.shape"),
        ([2, 2, 2], 7, "routed_experts.data"),  # bytes do not fill the shape
        ([2, 2, 2], 9, "routed_experts.data"),
    ],
)
def test_a_shape_that_does_not_match_the_data_is_refused(
    shape: list[int], data_bytes: int, field: str
) -> None:
    message = common_pb2.RoutedExperts(
        data=bytes(data_bytes), shape=shape, dtype=common_pb2.INDEX_DTYPE_UINT8
    )
    with pytest.raises(RoutedExpertsError, match=field):
        routed_experts.check(message, num_tokens=2)


# Envs forwards what inference sent --------------------------------------------------------
PROMPT = [5, 6, 7]
GENERATED = [8, 9]


class _Inference(inference_pb2_grpc.InferenceServiceServicer):
    """Answers every Generate with GENERATED and a fixed routed-experts message."""

    def __init__(self, routed: common_pb2.RoutedExperts) -> None:
        self.routed = routed

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        yield inference_pb2.GenerateResponse(token_ids=GENERATED[:1], logprobs=[-0.5])
        yield inference_pb2.GenerateResponse(
            token_ids=GENERATED[1:],
            logprobs=[-0.25],
            offset=1,
            finish_reason=inference_pb2.FINISH_REASON_STOP,
            routed_experts=self.routed,
        )


async def _generate(routed: common_pb2.RoutedExperts) -> SegmentBuilder:
    port = free_port()
    server = aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(_Inference(routed), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with make_channel(f"127.0.0.1:{port}", token=None) as channel:
            generation = await InferenceGenerator(channel, temperature=1.0, seed=None)(
                PROMPT, 2, []
            )
    finally:
        await server.stop(0)
    segment = SegmentBuilder(list(PROMPT), len(PROMPT))
    segment.add_generated(generation)
    return segment


async def test_envs_forwards_inferences_bytes_into_the_segment_unchanged() -> None:
    # Odd values in a wide dtype: a decode-and-re-encode would narrow them to uint8.
    rows = len(PROMPT) + len(GENERATED) - 1
    table = np.arange(rows * 2 * 2, dtype="<i4").reshape(rows, 2, 2)
    sent = common_pb2.RoutedExperts(
        data=table.tobytes(), shape=[rows, 2, 2], dtype=common_pb2.INDEX_DTYPE_INT32
    )
    segment = (await _generate(sent)).to_proto()
    assert segment.routed_experts == sent
    assert list(segment.token_ids) == PROMPT + GENERATED


@pytest.mark.parametrize(
    ("routed", "match"),
    [
        (common_pb2.RoutedExperts(data=bytes(16), shape=[4, 2, 2], dtype=9), "index dtype 9"),  # type: ignore[arg-type]
        (
            common_pb2.RoutedExperts(data=bytes(8), shape=[2, 2, 2], dtype=1),
            "2 token rows for 5 tokens",
        ),
    ],
)
async def test_envs_refuses_a_reply_whose_routing_does_not_fit(
    routed: common_pb2.RoutedExperts, match: str
) -> None:
    with pytest.raises(RoutedExpertsError, match=f"GenerateResponse.routed_experts.*{match}"):
        await _generate(routed)
