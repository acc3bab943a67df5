"""Weight exchange: bit-exact round trips over many versions, shards, damage and bad input,
against the file store and a real S3-API server (moto over HTTP)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from services.config import WeightsConfig
from services.objectstore import ObjectStore
from services.objectstore.local import FileObjectStore
from services.weights import codec, metrics
from services.weights.manifest import Layout, WeightsError, read_latest, read_manifest
from services.weights.publisher import WeightPublisher
from services.weights.retention import collect_garbage
from services.weights.subscriber import WeightSubscriber
from tests.objectstore_support import s3_store

RUN = "test-run"


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


# --- codec -----------------------------------------------------------------------------


SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3.5, 448.0, 65504.0]


@pytest.mark.parametrize("dtype", list(codec.DTYPE_NAMES))
@pytest.mark.parametrize("change", [0.0, 0.01, 0.6])
def test_codec_round_trip_is_bit_exact(dtype: torch.dtype, change: float) -> None:
    generator = torch.Generator().manual_seed(0)
    base = (torch.randn(4099, generator=generator) * 0.02).to(dtype)
    base_bits = codec.to_bits(base).copy()
    base_bits[: len(SPECIALS)] = codec.to_bits(torch.tensor(SPECIALS).to(dtype))
    current = base_bits.copy()
    flip = torch.rand(current.size, generator=generator).numpy() < change
    current[flip] ^= 1  # the lowest mantissa bit, as a small optimizer step does
    if current.itemsize >= 2:
        current[:3] = np.array([0x7FC1, 0xFFFF, 0x0001], dtype=np.uint32).astype(
            current.dtype
        )  # NaN payloads
    for base_arg in (None, base_bits):
        encoding, payload = codec.encode(current, base_arg)
        assert (encoding == "raw") == (base_arg is None)
        decoded = codec.decode(encoding, payload, base_arg, current.dtype, current.size)
        assert decoded.dtype == current.dtype and np.array_equal(decoded, current)
    tensor = codec.from_bits(decoded, codec.dtype_name(dtype), (current.size,))
    assert tensor.dtype == dtype


def test_sparse_deltas_are_small() -> None:
    weights = torch.randn(1 << 20) * 0.02
    before = weights.to(torch.bfloat16)
    after = (weights - 1e-6 * torch.sign(torch.randn(1 << 20))).to(torch.bfloat16)
    encoding, payload = codec.encode(codec.to_bits(after), codec.to_bits(before))
    assert encoding == "xor_sparse"
    # ~4% of the words change; plain zstd of the XOR stream needs ~1/21 of the bytes.
    assert len(payload) < before.numel() * 2 / 35


def test_codec_refuses_what_it_cannot_decode() -> None:
    bits = codec.to_bits(torch.ones(100, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="not supported"):
        codec.to_bits(torch.ones(3, dtype=torch.int64))
    changed = bits.copy()
    changed[::7] ^= 3
    encoding, payload = codec.encode(changed, bits)
    with pytest.raises(codec.CodecError, match="needs the base"):
        codec.decode(encoding, payload, None, bits.dtype, bits.size)
    with pytest.raises(codec.CodecError, match="corrupt"):
        codec.decode(encoding, payload[:-3] + b"abc", bits, bits.dtype, bits.size)
    with pytest.raises(codec.CodecError, match="corrupt"):
        codec.decode("raw", codec.encode(changed, None)[1][:-9], None, bits.dtype, bits.size)
    count, gap_length = struct.unpack_from("<QQ", payload)
    bad_gaps = zstandard.ZstdCompressor().compress(bytes([127] * count))  # runs past the end
    forged = struct.pack("<QQ", count, len(bad_gaps)) + bad_gaps + payload[16 + gap_length :]
    with pytest.raises(codec.CodecError, match="positions do not fit"):
        codec.decode("xor_sparse", forged, bits, bits.dtype, bits.size)
    with pytest.raises(codec.CodecError, match="unknown encoding"):
        codec.decode("lz4", payload, bits, bits.dtype, bits.size)
    with pytest.raises(codec.CodecError, match="unknown dtype"):
        codec.from_bits(bits, "fp4", (100,))
    with pytest.raises(codec.CodecError, match="do not make"):
        codec.from_bits(bits, "bf16", (99,))


# --- publishing and loading --------------------------------------------------------------


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return FileObjectStore(tmp_path / "store")
    return s3_store(request.getfixturevalue("moto_endpoint"))


def config(**overrides: object) -> WeightsConfig:
    values: dict[str, object] = {
        "keyframe_interval": 4,
        "group_bytes": 6000,
        "concurrency": 4,
        "collect_garbage": False,  # tests look at every version
        **overrides,
    }
    return WeightsConfig(**values)  # type: ignore[arg-type]


def versions_of_a_model(count: int, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """States of a small mixed-dtype model as an optimizer would move it."""
    generator = torch.Generator().manual_seed(seed)
    master = {
        "embed.weight": torch.randn(64, 48, generator=generator) * 0.02,
        "layers.0.mlp.experts.gate_up": torch.randn(4, 96, 48, generator=generator) * 0.02,
        "layers.0.norm.weight": torch.ones(48),
        "head.scale": torch.randn(32, generator=generator),
    }
    for version in range(count):
        for name, tensor in master.items():
            if name != "layers.0.norm.weight" or version % 5 == 4:
                tensor -= 1e-4 * torch.sign(torch.randn(tensor.shape, generator=generator))
        if version == 6:
            master["head.scale"] = torch.randn(32, generator=generator)  # a dense change
        yield {
            "embed.weight": master["embed.weight"].to(torch.bfloat16),
            "layers.0.mlp.experts.gate_up": master["layers.0.mlp.experts.gate_up"].to(
                torch.bfloat16
            ),
            "layers.0.norm.weight": master["layers.0.norm.weight"].to(torch.float32),
            "head.scale": master["head.scale"].to(torch.float8_e4m3fn),
        }


def publish_all(
    store: ObjectStore, states: list[dict[str, torch.Tensor]], settings: WeightsConfig
) -> list[object]:
    publisher = WeightPublisher(store, RUN, settings)
    results = [
        publisher.publish(state, version).result(timeout=60) for version, state in enumerate(states)
    ]
    publisher.close()
    return results


def test_every_version_round_trips_from_any_starting_point(store: ObjectStore) -> None:
    states = list(versions_of_a_model(12))
    results = publish_all(store, states, config())
    layout = Layout(RUN)
    assert read_latest(store, layout) == 11
    keyframes = [v for v in range(12) if read_manifest(store, layout, v).keyframe]
    assert keyframes == [0, 4, 8]
    assert all(r.manifest_written for r in results)  # type: ignore[attr-defined]
    assert sum(r.stored_bytes for r in results[1:4]) < sum(r.raw_bytes for r in results[1:4]) / 3  # type: ignore[attr-defined]
    for start in range(12):
        subscriber = WeightSubscriber(store, RUN, config())
        loaded = subscriber.load(start)
        assert all(bits_equal(loaded[n], states[start][n]) for n in states[start])
        for target in range(start + 1, 12, 3):
            loaded = subscriber.load(target)
            assert set(loaded) == set(states[target])
            for name, tensor in states[target].items():
                assert bits_equal(loaded[name], tensor), (start, target, name)


def test_shards_are_published_together_or_not_at_all(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    settings = config(shard_wait_s=1.0, publish_attempts=1)
    shards = [WeightPublisher(store, RUN, settings, shard=s, num_shards=2) for s in range(2)]
    states = list(versions_of_a_model(4))
    halves = [sorted(states[0])[:2], sorted(states[0])[2:]]
    for version in range(3):
        futures = [
            shards[s].publish({n: states[version][n] for n in halves[s]}, version) for s in range(2)
        ]
        assert [f.result(timeout=30).manifest_written for f in futures] == [True, False]
    # Shard 1 never publishes version 3: shard 0 gives up and writes no manifest.
    lone = shards[0].publish({n: states[3][n] for n in halves[0]}, 3)
    with pytest.raises(WeightsError, match="shard 1 did not publish"):
        lone.result(timeout=30)
    layout = Layout(RUN)
    assert read_latest(store, layout) == 2
    assert not store.exists(layout.manifest(3)) and store.exists(layout.object(3, 0, 0))
    subscriber = WeightSubscriber(store, RUN, config())
    with pytest.raises(WeightsError, match="version 3 of test-run has no manifest"):
        subscriber.load(3)
    loaded = subscriber.load(2)
    assert all(bits_equal(loaded[n], states[2][n]) for n in states[2])
    for publisher in shards:
        publisher.close()


def test_damaged_objects_are_never_loaded_and_keyframes_recover(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    states = list(versions_of_a_model(10))
    publish_all(store, states, config())
    layout = Layout(RUN)
    damaged = read_manifest(store, layout, 5).objects[0].key
    data = bytearray(store.get(damaged))
    data[len(data) // 2] ^= 0xFF
    store.put(damaged, bytes(data))
    subscriber = WeightSubscriber(store, RUN, config())
    subscriber.load(4)
    with pytest.raises(WeightsError, match=f"object {damaged} does not match its SHA-256"):
        subscriber.load(5)
    with pytest.raises(WeightsError, match=damaged):
        subscriber.load(6)  # its deltas apply to the damaged version 5
    assert subscriber.version == 4  # still serving what it had
    loaded = subscriber.load(9)  # the next keyframe (8) does not need version 5
    assert all(bits_equal(loaded[n], states[9][n]) for n in states[9])


def test_a_damaged_cache_falls_back_to_the_keyframe_chain(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    states = list(versions_of_a_model(7))
    publish_all(store, states, config())
    subscriber = WeightSubscriber(store, RUN, config())
    subscriber.load(5)
    subscriber._state["embed.weight"][7] ^= 0x0100  # memory corruption on the replica
    before = metrics.FALLBACKS.labels("crc_mismatch")._value.get()
    loaded = subscriber.load(6)
    assert metrics.FALLBACKS.labels("crc_mismatch")._value.get() == before + 1
    assert all(bits_equal(loaded[n], states[6][n]) for n in states[6])


@pytest.mark.parametrize("damage", ["truncated", "wrong_hash", "unknown_dtype", "version_gap"])
def test_bad_versions_are_clear_errors_naming_the_object(tmp_path: Path, damage: str) -> None:
    store = FileObjectStore(tmp_path)
    states = list(versions_of_a_model(3))
    publish_all(store, states, config())
    layout = Layout(RUN)
    manifest = read_manifest(store, layout, 2)
    key = manifest.objects[0].key
    if damage == "truncated":
        store.put(key, store.get(key)[:-10])
        expected = f"object {key} has"
    elif damage == "wrong_hash":
        changed = manifest.model_copy(
            update={
                "objects": [
                    manifest.objects[0].model_copy(update={"sha256": "0" * 64}),
                    *manifest.objects[1:],
                ]
            }
        )
        store.put(layout.manifest(2), changed.model_dump_json().encode())
        expected = f"object {key} does not match"
    elif damage == "unknown_dtype":
        raw = json.loads(store.get(layout.manifest(2)))
        raw["tensors"][0]["dtype"] = "fp4_e2m1"
        store.put(layout.manifest(2), json.dumps(raw).encode())
        expected = (
            f"tensor {raw['tensors'][0]['name']} in {raw['tensors'][0]['object']}: unknown dtype"
        )
    else:
        store.delete([layout.manifest(1)])
        expected = "version 2 needs version 1: version 1 of test-run has no manifest"
    with pytest.raises(WeightsError, match=expected.replace(".", r"\.")):
        WeightSubscriber(store, RUN, config()).load(2)
    with pytest.raises(WeightsError, match="version 17 of test-run has no manifest"):
        read_manifest(store, layout, 17)
    store.put(layout.manifest(2), b'{"format": 1}')
    with pytest.raises(WeightsError, match="is not a valid manifest"):
        read_manifest(store, layout, 2)


def test_retention_keeps_the_keyframe_chain(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    states = list(versions_of_a_model(11))
    publish_all(store, states, config())
    layout = Layout(RUN)
    store.put(layout.object(12, 0, 0), b"debris of a crashed publish")  # no manifest, newer
    store.put(layout.object(3, 0, 7), b"debris of an old crashed publish")
    removed = collect_garbage(store, RUN, keep_last=2)
    assert removed == [0, 1, 2, 3, 4, 5, 6, 7]
    assert collect_garbage(store, RUN, keep_last=2) == []
    assert store.exists(layout.object(12, 0, 0))  # beyond latest: maybe still being written
    loaded = WeightSubscriber(store, RUN, config()).load(10)
    assert all(bits_equal(loaded[n], states[10][n]) for n in states[10])


def test_follow_yields_newer_versions_from_notices_and_polling(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    states = list(versions_of_a_model(3))
    publisher = WeightPublisher(store, RUN, config())
    publisher.publish(states[0], 0).result(timeout=30)
    subscriber = WeightSubscriber(store, RUN, config(poll_interval_s=0.1))

    async def notices() -> AsyncIterator[int]:
        yield 0  # stale: ignored
        await asyncio.sleep(3600)

    async def run() -> list[int]:
        seen: list[int] = []
        follower = subscriber.follow(notices(), after=-1)
        seen.append(await anext(follower))
        publisher.publish(states[1], 1).result(timeout=30)
        publisher.publish(states[2], 2).result(timeout=30)
        async with asyncio.timeout(10):
            while seen[-1] < 2:
                seen.append(await anext(follower))
        await follower.aclose()
        return seen

    seen = asyncio.run(run())
    publisher.close()
    assert seen[0] == 0 and seen[-1] == 2 and seen == sorted(set(seen))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("backend", ["file", "s3"])
def test_killing_the_publisher_mid_upload_keeps_latest_complete(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    if backend == "file":
        store: ObjectStore = FileObjectStore(tmp_path / "store")
        args = ["--url", f"file://{tmp_path / 'store'}"]
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        store = s3_store(endpoint)
        args = ["--url", store.url, "--endpoint", endpoint]
    layout = Layout(RUN)
    states = list(versions_of_a_model(6))

    def publisher(first: int, last: int, slow_after: int = -1) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.weights_publisher_proc",
                *args,
                "--first",
                str(first),
                "--last",
                str(last),
                "--slow-after",
                str(slow_after),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    doomed = publisher(0, 5, slow_after=3)
    deadline = time.monotonic() + 60
    while not store.list(f"{layout.version_dir(3)}/"):  # version 3 has started uploading
        assert doomed.poll() is None and time.monotonic() < deadline, doomed.communicate()
        time.sleep(0.01)
    doomed.kill()
    doomed.wait()
    assert read_latest(store, layout) == 2
    assert not store.exists(layout.manifest(3))
    assert store.list(f"{layout.version_dir(3)}/")  # debris of the interrupted upload
    subscriber = WeightSubscriber(store, RUN, config())
    loaded = subscriber.load(read_latest(store, layout))  # type: ignore[arg-type]
    assert all(bits_equal(loaded[n], states[2][n]) for n in states[2])
    with pytest.raises(WeightsError, match="no manifest"):
        subscriber.load(3)
    # A restarted trainer has no cache: it republishes version 3 as a keyframe.
    restarted = publisher(3, 5)
    _, errors = restarted.communicate(timeout=120)
    assert restarted.returncode == 0, errors
    assert read_latest(store, layout) == 5 and read_manifest(store, layout, 3).keyframe
    for version in (3, 5):
        loaded = subscriber.load(version)
        assert all(bits_equal(loaded[n], states[version][n]) for n in states[version])


def test_the_publisher_collects_garbage_as_it_goes(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    states = list(versions_of_a_model(10))
    publish_all(store, states, config(collect_garbage=True, keep_last=1))
    layout = Layout(RUN)
    from services.weights.manifest import list_versions

    assert list_versions(store, layout) == [8, 9]  # the newest keyframe chain
    loaded = WeightSubscriber(store, RUN, config()).load(9)
    assert all(bits_equal(loaded[n], states[9][n]) for n in states[9])
