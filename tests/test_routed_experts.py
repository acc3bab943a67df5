"""The routed-experts wire format (services.routed_experts): round trip, what it refuses,
and envs stitching inference's per-call tables into the rollout record."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

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
    """Answers every Generate with GENERATED and a routed-experts message: a fixed one,
    or (``routes`` given) the rows of ``routes(prompt + generated)`` from the request's
    ``routed_experts_from``, as a replica does."""

    def __init__(
        self,
        routed: common_pb2.RoutedExperts | None = None,
        routes: Callable[[list[int]], np.ndarray] | None = None,
        start_offset: int = 0,
    ) -> None:
        self.routed = routed
        self.routes = routes
        self.start_offset = start_offset  # a faulty replica answers from another row
        self.requests: list[inference_pb2.GenerateRequest] = []

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        self.requests.append(request)
        yield inference_pb2.GenerateResponse(token_ids=GENERATED[:1], logprobs=[-0.5])
        start = max(0, request.routed_experts_from + self.start_offset)
        routed = self.routed
        if self.routes is not None:
            ran = [*request.prompt_token_ids, *GENERATED][:-1]
            routed = routed_experts.encode(self.routes(ran)[start:])
        yield inference_pb2.GenerateResponse(
            token_ids=GENERATED[1:],
            logprobs=[-0.25],
            offset=1,
            finish_reason=inference_pb2.FINISH_REASON_STOP,
            routed_experts=routed,
            routed_experts_start=start,
        )


async def _generate_turns(
    servicer: _Inference, turns: int = 1, tool_output: Sequence[int] = ()
) -> SegmentBuilder:
    """``turns`` generations into one segment, ``tool_output`` injected between them, each
    asking for routes from where the segment's end (as the harness does)."""
    port = free_port()
    server = aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    segment = SegmentBuilder(list(PROMPT), len(PROMPT))
    try:
        async with make_channel(f"127.0.0.1:{port}", token=None) as channel:
            generate = InferenceGenerator(channel, temperature=1.0, seed=None)
            for turn in range(turns):
                if turn:
                    segment.add_injected(list(tool_output))
                segment.add_generated(await generate(segment.token_ids, 2, [], segment.num_routed))
    finally:
        await server.stop(0)
    return segment


async def _generate(routed: common_pb2.RoutedExperts) -> SegmentBuilder:
    return await _generate_turns(_Inference(routed))


async def test_envs_keeps_inferences_routes_for_one_call() -> None:
    rows = len(PROMPT) + len(GENERATED) - 1
    table = np.arange(rows * 2 * 2, dtype="<i4").reshape(rows, 2, 2)
    sent = common_pb2.RoutedExperts(
        data=table.tobytes(), shape=[rows, 2, 2], dtype=common_pb2.INDEX_DTYPE_INT32
    )
    segment = (await _generate(sent)).to_proto()
    # Forwarded as inference packed it: the same bytes, width and shape (int32 here,
    # though uint8 would hold these indices: envs never re-encodes).
    assert segment.routed_experts == sent
    assert list(segment.token_ids) == PROMPT + GENERATED


def test_join_forwards_bytes_and_widens_only_mixed_widths() -> None:
    rows = np.arange(8).reshape(2, 2, 2)
    small = routed_experts.encode(rows)
    assert small.dtype == common_pb2.INDEX_DTYPE_UINT8
    same = routed_experts.join([small, small])
    assert same.data == small.data * 2 and list(same.shape) == [4, 2, 2]
    assert same.dtype == common_pb2.INDEX_DTYPE_UINT8
    unrouted = routed_experts.encode(np.full((1, 2, 2), -1))
    assert unrouted.dtype == common_pb2.INDEX_DTYPE_INT16
    mixed = routed_experts.join([small, unrouted, small])
    assert mixed.dtype == common_pb2.INDEX_DTYPE_INT16
    decoded = routed_experts.decode(mixed, 5)
    assert decoded is not None
    np.testing.assert_array_equal(decoded, np.concatenate([rows, np.full((1, 2, 2), -1), rows]))
    other_layers = routed_experts.encode(np.zeros((1, 3, 2), dtype=np.int64))
    with pytest.raises(routed_experts.RoutedExpertsError, match=r"segment\.shape"):
        routed_experts.join([small, other_layers], "segment")


def _routes_of_call(call: int) -> Callable[[list[int]], np.ndarray]:
    """A replica whose every call routes every position differently (as after an update)."""

    def routes(ran: list[int]) -> np.ndarray:
        positions = np.arange(len(ran))[:, None, None]
        return np.broadcast_to(1000 * call + positions, (len(ran), 2, 2)).copy()

    return routes


async def test_envs_stitches_each_calls_new_rows_and_keeps_the_earlier_ones() -> None:
    """Three turns with tool output between them: each call asks for the rows from the end
    of what the segment holds, and the record keeps every position's first row -- the
    earlier turns' rows are not replaced by a later call's re-prefill."""
    calls = iter(range(1, 10))
    routes = _routes_of_call(0)

    def per_call(ran: list[int]) -> np.ndarray:
        nonlocal routes
        routes = _routes_of_call(next(calls))
        return routes(ran)

    servicer = _Inference(routes=per_call)
    tool_output = [30, 31, 32]
    segment = await _generate_turns(servicer, turns=3, tool_output=tool_output)
    record = segment.to_proto()
    tokens = list(record.token_ids)
    assert tokens == PROMPT + GENERATED + tool_output + GENERATED + tool_output + GENERATED
    assert [r.routed_experts_from for r in servicer.requests] == [0, 4, 9]
    table = routed_experts.decode(record.routed_experts, len(tokens))
    assert table is not None and table.shape == (len(tokens) - 1, 2, 2)
    # Rows 0-3 from call 1, 4-8 from call 2 (turn 1's last token, the tool output and
    # the prompt's end), 9-13 from call 3: each row its first computation's.
    call_of_row = table[:, 0, 0] // 1000
    assert call_of_row.tolist() == [1] * 4 + [2] * 5 + [3] * 5
    assert (table[:, 0, 0] % 1000).tolist() == list(range(len(tokens) - 1))
    # Bytes linear in the tokens: every row went over the wire once.
    assert segment.routing_bytes == (len(tokens) - 1) * 2 * 2 * np.dtype("<i2").itemsize


async def test_envs_refuses_routes_that_start_elsewhere_than_asked() -> None:
    servicer = _Inference(routes=_routes_of_call(1), start_offset=-1)
    with pytest.raises(RoutedExpertsError, match="routed_experts_start: 3, asked for rows from 4"):
        await _generate_turns(servicer, turns=2)


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
